"""Engines that run a model's programs: the rollout sampler (and later the hybrid engine)."""

from hfjax.engine.sampler import GenerateOutput, Sampler, SamplingParams, bucket_size, generate

__all__ = ["GenerateOutput", "Sampler", "SamplingParams", "bucket_size", "generate"]
