"""Constants of the formats the stages hand each other (docs/formats.md), read by more than one stage.

The pipeline writes token shards whose documents each end in EOT; training packs them as they are, the HF export
declares EOT as its eos token, and serving conditions every prompt on it. One definition, so the stages cannot
drift apart.
"""

EOT = "<|endoftext|>"  # the end-of-document token of every tokenizer.json the pipeline writes or accepts
