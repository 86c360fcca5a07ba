"""Proxy MoE language models: measured inference quality instead of an assumed one.

The quality model of Section III-C needs q per expert and precision and
Q_sub per substitute, measured as KL divergence from the full-precision output
on calibration text. The evaluated models (Mixtral-8x7B, Qwen1.5-MoE-A2.7B,
Switch-Base-8) cannot run here, so each gets a proxy with its exact MoE shape
(layers, experts per layer, top-k, Qwen's shared expert) and a tiny width,
trained on CPU on real text (Python's documentation, ``data``). On it:

- ``profile``: q (INT8 per-channel, INT4 group-wise) and Q_sub of every
  expert, written with ``workloads.quality_profile.save_profile`` so a spec can
  use it (``quality: {profile: results/quality/mixtral-8x7b/profile.npz}``);
- ``trace``: the proxy's own routing on held-out text as a JSON-lines trace,
  so a run (``workload: {trace: PATH.jsonl}``) serves real routing of known text;
- ``replay``: recorded choices (substitutes, precisions) re-executed on that
  text: measured per-request degradation and perplexity change; reading a run
  folder's records for it is ``testbed.quality_replay`` (``python -m testbed
  quality-replay RUN``), the surrogate plot ``analysis/quality/surrogate.py``.
- ``inrun``: one token through the proxy one layer at a time, as emulated
  workers run it during a run with ``quality.inrun`` (real hidden states over
  the sockets, trained experts at the replica's precision, per-token KL
  scored by the home server; the run's side is ``testbed.quality_inrun``).

This package is model code only: it imports ``hetroute`` and ``workloads``,
never ``testbed`` or ``analysis`` (tests/test_layering.py).

Command line: ``python -m workloads.proxy {train,profile,trace}``.
Weights are cached in ``<repo>/.cache/proxy/`` (git-ignored), keyed by a hash
of the config, the text and the training code. Nothing here keeps global
state; torch runs single-threaded from the command line for reproducibility.
"""
