"""The torch backend's transforms: what changes a model's layers, each all or nothing.

``apply`` (``apply_qat``: wrap for QAT), ``convert`` (QAT or float to integer layers, PTQ),
``swap`` (the atomic module swap they share), ``adapters`` (LoRA apply and merge), ``gptq`` and
``importance`` (calibrated PTQ and the importance matrix).
"""
