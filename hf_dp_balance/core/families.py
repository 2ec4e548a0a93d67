"""Names every core module that builds or reads a packed row shares, kept here so none imports another for them.

`QWEN_FAMILIES`: the model types whose samples carry ``mm_token_type_ids`` and 4-row (mrope) position ids.
`IGNORE_INDEX`: the label value transformers' causal-LM losses skip.
"""

IGNORE_INDEX = -100
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
