"""Pretrained models from other toolkits: Marian / OPUS-MT import and export back."""
