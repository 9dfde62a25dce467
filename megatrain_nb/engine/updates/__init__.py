"""From a unit's final gradient to its next weights: the gradient intake (sum, reduce,
non-finite check, hold for the global norm), the update scheduler and its runner (decode the
optimizer states, the fused AdamW, encode, write back, the compute-dtype copy a load needs), the
optimizer-state codecs (int8/int4 block codes: lossy with respect to fp32 Adam, bit-exact on
resume) and the states' storage per tier.
"""
