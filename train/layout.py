"""Names in a training run dir that the trainer writes and other modules read (docs/formats.md, "Training run
directory").

Deliberately free of imports: ``train.export`` (hence every serving replica) needs these names without
importing the trainer, torch.distributed.checkpoint or matplotlib.
"""

FINAL_DIR = "final"  # <run>/final/: what rank 0 writes at the end for train.export
FINAL_MODEL = "model.safetensors"  # full, unsharded state dict (plain GPT parameter names)
FINAL_INFO = "final.json"  # step, model and train config, data manifest sha256, bad steps, resumes, ...
FINAL_PROBE = "probe.safetensors"  # fixed input tokens and the live model's logits on them
STOPPED = "stopped.json"  # a run that stopped on its own verdict (diverged, replicas differ): train.stop_verdict
