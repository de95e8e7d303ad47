"""One atomic writer for every file mixle writes: a failure at any step (the writer, the flush, the
rename, a KeyboardInterrupt) leaves the previous file or checkpoint directory byte for byte as it
was and no temporary file behind; a success keeps the umask's (or the old file's) mode and writes
through a symbolic link."""

import os
import stat

import pytest

torch = pytest.importorskip("torch")

from mixle.core.fileformat import replace_atomically, replace_directory_atomically  # noqa: E402
from mixle.torch_backend.transforms.convert import quantize_model  # noqa: E402
from mixle.torch_backend.export import save_quantized  # noqa: E402


class Boom(OSError):
    pass


def snapshot(directory):
    """``{relative path: bytes}`` of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as handle:
                out[os.path.relpath(full, directory)] = handle.read()
    return out


def small_model(seed):
    torch.manual_seed(seed)
    return quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4)


def failing(monkeypatch, module, name, when=lambda *a, **k: True, error=Boom("injected")):
    """Make ``module.name`` raise ``error`` on the calls ``when`` selects (the others run)."""
    real = getattr(module, name)

    def fake(*args, **kwargs):
        if when(*args, **kwargs):
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)


def _broken_writer(error):
    def write(*args, **kwargs):
        path = args[1] if len(args) > 1 else kwargs["filename"]
        with open(path, "wb") as handle:
            handle.write(b"half a file")
        raise error
    return write


FILE_STEPS = {
    "writer": lambda mp: failing(mp, __import__("safetensors.torch").torch, "save_file", error=Boom("disk full")),
    "interrupt": lambda mp: mp.setattr(__import__("safetensors.torch").torch, "save_file",
                                       _broken_writer(KeyboardInterrupt())),
    "partial-writer": lambda mp: mp.setattr(__import__("safetensors.torch").torch, "save_file",
                                            _broken_writer(Boom("disk full"))),
    "chmod": lambda mp: failing(mp, os, "chmod"),
    "fsync": lambda mp: failing(mp, os, "fsync"),
    "replace": lambda mp: failing(mp, os, "replace"),
}


@pytest.mark.parametrize("step", sorted(FILE_STEPS))
def test_save_quantized_failing_at_any_step_keeps_the_previous_file(tmp_path, monkeypatch, step):
    path = tmp_path / "m.safetensors"
    save_quantized(small_model(0), path)
    before = path.read_bytes()
    FILE_STEPS[step](monkeypatch)
    with pytest.raises((Boom, KeyboardInterrupt)):
        save_quantized(small_model(1), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]  # no temporary file left


def test_a_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_mode(tmp_path):
    old = os.umask(0o027)
    try:
        save_quantized(small_model(0), tmp_path / "new.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.safetensors").st_mode) == 0o640
    os.chmod(tmp_path / "new.safetensors", 0o600)
    save_quantized(small_model(1), tmp_path / "new.safetensors")
    assert stat.S_IMODE(os.stat(tmp_path / "new.safetensors").st_mode) == 0o600


def test_writing_through_a_symlink_replaces_its_target(tmp_path):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "m.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    save_quantized(small_model(0), link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() != b"old" and target.read_bytes()[:8] == link.read_bytes()[:8]
    assert os.listdir(tmp_path / "store") == ["m.safetensors"] and sorted(os.listdir(tmp_path)) == ["link.safetensors",
                                                                                                    "store"]


def test_replace_atomically_removes_a_temporary_file_the_writer_replaced(tmp_path):
    def write(tmp):
        os.remove(tmp)  # e.g. a writer that deletes and recreates its output
        with open(tmp, "w") as handle:
            handle.write("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(tmp_path / "x.txt", write)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# GGUF


@pytest.fixture
def gguf_model():
    pytest.importorskip("gguf")
    from mixle.models.qat import apply_qat
    from mixle.models.transformer import build_causal_lm

    def make(seed):
        torch.manual_seed(seed)
        lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8, activation="gelu_tanh")
        return apply_qat(lm, grid="q4_0")
    return make


GGUF_STEPS = {
    "writer": lambda mp, gguf: failing(mp, gguf.GGUFWriter, "write_tensors_to_file", error=Boom("disk full")),
    "interrupt": lambda mp, gguf: failing(mp, gguf.GGUFWriter, "write_kv_data_to_file", error=KeyboardInterrupt()),
    "fsync": lambda mp, gguf: failing(mp, os, "fsync"),
    "replace": lambda mp, gguf: failing(mp, os, "replace"),
}


@pytest.mark.parametrize("step", sorted(GGUF_STEPS))
def test_save_gguf_failing_at_any_step_keeps_the_previous_file(tmp_path, monkeypatch, gguf_model, step):
    import gguf

    from mixle.gguf.writer import save_gguf

    path = tmp_path / "lm.gguf"
    save_gguf(gguf_model(0), path)
    before = path.read_bytes()
    GGUF_STEPS[step](monkeypatch, gguf)
    with pytest.raises((Boom, KeyboardInterrupt)):
        save_gguf(gguf_model(1), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["lm.gguf"]


def test_save_gguf_keeps_the_mode_and_writes_through_a_symlink(tmp_path, gguf_model):
    from mixle.gguf.writer import save_gguf

    target = tmp_path / "real.gguf"
    save_gguf(gguf_model(0), target)
    os.chmod(target, 0o604)
    link = tmp_path / "lm.gguf"
    link.symlink_to(target)
    save_gguf(gguf_model(1), link)
    assert link.is_symlink() and stat.S_IMODE(os.stat(target).st_mode) == 0o604
    assert sorted(os.listdir(tmp_path)) == ["lm.gguf", "real.gguf"]


# ----------------------------------------------------------------------------------------------
# compressed-tensors checkpoint directories


@pytest.fixture
def hf_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")

    def make(seed):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)
        return quantize_model(transformers.LlamaForCausalLM(config), bits=4, group_size=8, exclude=("lm_head",))
    return make


class RaisingTokenizer:
    def __init__(self, error):
        self.error = error

    def save_pretrained(self, directory):
        with open(os.path.join(directory, "tokenizer.json"), "w") as handle:
            handle.write("{")
        raise self.error


DIRECTORY_STEPS = {
    "writer": (lambda mp: None, Boom("disk full")),
    "interrupt": (lambda mp: None, KeyboardInterrupt()),
    "chmod": (lambda mp: failing(mp, os, "chmod", when=lambda path, mode: str(path).endswith(".partial")), None),
    "fsync": (lambda mp: failing(mp, os, "fsync"), None),
    "rename-aside": (lambda mp: failing(mp, os, "rename", when=lambda src, dst: str(dst).endswith("previous")), None),
    "rename-in": (lambda mp: failing(mp, os, "rename", when=lambda src, dst: str(src).endswith(".partial")), None),
    "rename-in-interrupted": (lambda mp: failing(mp, os, "rename", when=lambda src, dst: str(src).endswith(".partial"),
                                                 error=KeyboardInterrupt()), None),
}


@pytest.mark.parametrize("step", sorted(DIRECTORY_STEPS))
def test_save_pretrained_compressed_overwrite_failing_at_any_step_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, hf_model, step):
    from mixle.exports.compressed_tensors import save_pretrained_compressed

    target = tmp_path / "ckpt"
    save_pretrained_compressed(hf_model(0), target)
    (target / "notes.txt").write_text("the user's own file")
    before = snapshot(target)
    inject, tokenizer_error = DIRECTORY_STEPS[step]
    inject(monkeypatch)
    tokenizer = RaisingTokenizer(tokenizer_error) if tokenizer_error is not None else None
    with pytest.raises((Boom, KeyboardInterrupt)):
        save_pretrained_compressed(hf_model(1), target, tokenizer=tokenizer, overwrite=True)
    monkeypatch.undo()
    assert snapshot(target) == before
    assert os.listdir(tmp_path) == ["ckpt"]  # no staging or set-aside directory left


def test_save_pretrained_compressed_into_an_empty_directory_failing_leaves_it_empty(tmp_path, monkeypatch, hf_model):
    from mixle.exports.compressed_tensors import save_pretrained_compressed

    (tmp_path / "ckpt").mkdir()
    failing(monkeypatch, os, "replace", when=lambda src, dst: str(src).endswith(".partial"))
    with pytest.raises(Boom):
        save_pretrained_compressed(hf_model(0), tmp_path / "ckpt")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(tmp_path / "ckpt") == []


def test_save_pretrained_compressed_overwrite_replaces_the_whole_directory(tmp_path, hf_model):
    from mixle.exports.compressed_tensors import save_pretrained_compressed

    target = tmp_path / "ckpt"
    save_pretrained_compressed(hf_model(0), target)
    (target / "stale.txt").write_text("old")
    first = snapshot(target)
    old = os.umask(0o022)
    try:
        save_pretrained_compressed(hf_model(1), target, overwrite=True)
    finally:
        os.umask(old)
    second = snapshot(target)
    assert "stale.txt" not in second and second.keys() == first.keys() - {"stale.txt"}
    assert second["model.safetensors"] != first["model.safetensors"]
    assert os.listdir(tmp_path) == ["ckpt"] and stat.S_IMODE(os.stat(target).st_mode) == 0o755


def test_a_failed_restore_says_where_the_previous_directory_is(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.txt").write_text("mine")
    real = os.rename
    calls = []

    def rename(src, dst):
        calls.append((str(src), str(dst)))
        if len(calls) >= 2:  # the rename in, and the rename back
            raise Boom("device gone")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match=r"could not be moved back: it is at .*\.old/previous"):
        replace_directory_atomically(target, lambda tmp: (tmp / "b.txt").write_text("new"), overwrite=True)
    monkeypatch.undo()
    aside = calls[0][1]
    assert open(os.path.join(aside, "a.txt")).read() == "mine"  # nothing lost, only set aside
