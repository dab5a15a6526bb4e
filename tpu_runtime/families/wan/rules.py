"""Wan's sharding rule tables (see ``engine/sharding.py``): self-attention (attn1), cross-attention (attn2: q from
video, k/v from text, and the image k/v of the I2V models) and the feed-forward of every block, all Megatron-split;
the q/k RMS norms span all heads, so their weights follow q/k's split. umT5 by the shared T5 rules; the VAE and
the CLIP vision encoder replicated."""

from ...engine.encoders import UMT5_ENCODER_RULES

# torch Linear weights are [out, in]: column parallel = ("tp", None), row parallel = (None, "tp").
TRANSFORMER_RULES: tuple[tuple[str, tuple], ...] = (
    (r"blocks\.\d+\.attn[12]\.(to_[qkv]|add_[kv]_proj)\.weight$", ("tp", None)),
    (r"blocks\.\d+\.attn[12]\.(to_[qkv]|add_[kv]_proj)\.bias$", ("tp",)),
    (r"blocks\.\d+\.attn[12]\.norm_(q|k|added_k)\.weight$", ("tp",)),
    (r"blocks\.\d+\.attn[12]\.to_out\.0\.weight$", (None, "tp")),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.weight$", ("tp", None)),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.bias$", ("tp",)),
    (r"blocks\.\d+\.ffn\.net\.2\.weight$", (None, "tp")),
)

RULES = {"text_encoder": UMT5_ENCODER_RULES, "transformer": TRANSFORMER_RULES, "transformer_2": TRANSFORMER_RULES}
