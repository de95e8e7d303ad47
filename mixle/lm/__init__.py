"""The LM jobs on top: model families, one training loop and evaluator, the llama.cpp evaluation, the
report, the ``compare`` job and the CLI.

``config`` (the job's settings, also its CLI flags through ``flags``), ``data`` and ``windows``
(corpus, tokenizers, token windows), ``transformer`` (mixle's ``build_causal_lm``), ``family``
(what the jobs need of a causal LM: mixle's or a transformers one), ``loop`` (the one training loop
that ``compare``, through ``training``, and ``finetune``, through ``finetune_train``, configure),
``evaluation`` (the evaluator), ``grad_leaf``, ``distill``, ``llama_cpp_eval`` (a model from its GGUF file and
in llama.cpp), ``report`` (summary, table, plot, files), ``compare`` (the job) and ``cli``.
"""
