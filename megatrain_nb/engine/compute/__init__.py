"""The step's math on the device that is not the model's own code: the chunked loss head (token
losses and sequence-level objectives, so whole logits never exist), packed and long-context
attention helpers, MLP sequence tiling where a layer does not fit, and sampling for generate().
"""
