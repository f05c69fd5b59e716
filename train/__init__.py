"""train: GPT pretraining on the pipeline's token shards with Ray Train (see train/README.md)."""
