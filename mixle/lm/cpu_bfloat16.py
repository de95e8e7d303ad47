"""Whether bfloat16 autocast pays on this CPU: its matrix products timed beside float32's.

CPUs without bfloat16 instructions (on x86: neither AVX512_BF16 nor AMX) run torch's
bfloat16 products through conversions: on a 2-core Xeon with AVX-512 but neither, a 512 x 640 x
2048 product took 29.2 ms in bfloat16 against 8.4 ms in float32, and Gemma 3 270M's finetune
step 26 s against 15 s. There ``--dtype bfloat16`` saves memory and costs time, so ``mixle
finetune`` times one product of each before a bfloat16 run on the CPU, records the ratio in
``results.json`` and says when float32 is the faster choice.
"""

import statistics
import sys
import time

SHAPE = (256, 1024, 1024)  # rows x inner x columns of the timed product: about 0.5 GFLOP
SLOW = 1.25  # bfloat16 over float32 above this: worth a note


def product_seconds(torch, dtype, shape=SHAPE, repeats=5):
    """Median seconds of one ``rows x inner @ inner x columns`` product in ``dtype``, after a warm-up.

    >>> import torch
    >>> product_seconds(torch, torch.float32, shape=(8, 8, 8)) > 0
    True
    """
    rows, inner, columns = shape
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(rows, inner, generator=generator).to(dtype)
    right = torch.randn(inner, columns, generator=generator).to(dtype)
    left @ right
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        left @ right
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bfloat16_note(ratio):
    """The note for a run whose bfloat16 products take ``ratio`` times float32's, or None.

    >>> bfloat16_note(1.0) is None
    True
    >>> bfloat16_note(3.5)[:60]
    "note: --dtype bfloat16: this CPU's bfloat16 matrix products "
    """
    if ratio <= SLOW:
        return None
    return (f"note: --dtype bfloat16: this CPU's bfloat16 matrix products take {ratio:.1f}x the time of "
            f"float32's; --dtype float32 trains faster here, bfloat16 only saves memory")


def check_bfloat16(torch, config, echo):
    """For a bfloat16 run on the CPU: ``{"bfloat16_products_vs_float32": ratio}`` at torch's
    current thread count, with ``bfloat16_note`` printed to stderr when ``echo``; otherwise ``{}``.

    >>> import torch
    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> check_bfloat16(torch, FinetuneConfig(model="m", out="o"), echo=False)
    {}
    """
    if config.dtype != "bfloat16" or config.device != "cpu":
        return {}
    ratio = round(product_seconds(torch, torch.bfloat16) / product_seconds(torch, torch.float32), 2)
    note = bfloat16_note(ratio)
    if echo and note is not None:
        print(note, file=sys.stderr, flush=True)
    return {"bfloat16_products_vs_float32": ratio}
