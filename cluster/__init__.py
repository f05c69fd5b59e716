"""cluster: capacity planning (`python -m cluster.plan`) and the Ray cluster / job-submission set-up.

Modules: gpus (accelerator table), model_shape (GPT parameter shapes), flops (6·N·D, GPU-hours),
memory (ZeRO states, activations), checkpointing (Young/Daly), scaling (Chinchilla, Sardana et al.),
trainer_memory (our trainer's per-rank state bytes), job_spec (YAML schema), planner, plan (CLI).
"""
