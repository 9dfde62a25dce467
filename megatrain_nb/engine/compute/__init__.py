"""The step's math on the device that is not the model's own code: the chunked loss head (token
losses and sequence-level objectives, so whole logits never exist), packed and long-context
attention helpers, MLP sequence tiling where a layer does not fit, the layer-major streamed decoder
(decode.py: every row one token per pass, the KV cache on the device) and sampling for generate().
"""
