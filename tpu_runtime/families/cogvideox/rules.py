"""CogVideoX's sharding rule tables (see ``engine/sharding.py``): Megatron tensor parallelism over the joint
text+video attention and the feed-forward of every block; the T5 encoder by the shared T5 rules; the VAE
replicated (its work is split by sharding its input)."""

from ...engine.encoders import T5_ENCODER_RULES

# torch Linear weights are [out, in]: column parallel = ("tp", None), row parallel = (None, "tp").
TRANSFORMER_RULES: tuple[tuple[str, tuple], ...] = (
    (r"transformer_blocks\.\d+\.attn1\.to_[qkv]\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.attn1\.to_[qkv]\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.attn1\.to_out\.0\.weight$", (None, "tp")),
    (r"transformer_blocks\.\d+\.ff\.net\.0\.proj\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.ff\.net\.0\.proj\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.ff\.net\.2\.weight$", (None, "tp")),
)

RULES = {"text_encoder": T5_ENCODER_RULES, "transformer": TRANSFORMER_RULES}
