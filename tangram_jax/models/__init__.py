"""Flax NNX decoders for GQA model families and their weight loaders."""
