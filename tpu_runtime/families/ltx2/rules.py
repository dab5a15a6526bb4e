"""LTX-2's sharding rule tables (see ``engine/sharding.py``). Every attention of a transformer block — the video
and the sound self-attention (attn1, audio_attn1), their text cross-attention (attn2, audio_attn2) and the two
cross-modal ones (audio_to_video_attn, video_to_audio_attn) — and both feed-forwards are Megatron-split over ``tp``:
q/k/v and the first projection by output, the attention output and the second projection by input, so each needs
one all-reduce. The q/k RMS norms span all heads and follow q/k; 2.3's per-head gates follow the heads. Gemma 3's
decoder layers the same way (its 8 key/value heads split as far as they go), and its token embedding (262208 x
3840, 1.9 GiB in bf16) by its width. The text connectors' blocks too, where ``tp`` divides a connector's heads
(2.3: 32); where it does not (2.0: 30 heads on tp=8), their q/k/v and attention output are split by input instead
(each chip computes every head from a partial sum, one all-reduce each: heads are never cut in pieces), the
feed-forwards still by Megatron. Their input projections from Gemma's stacked hidden states (188160 wide) are split
by input: one all-reduce of the 1024 projected tokens. The VAEs, the vocoder and the upsampler are small and stay
whole."""

ATTENTIONS = r"(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"

# torch Linear weights are [out, in]: column parallel = ("tp", None), row parallel = (None, "tp").
TRANSFORMER_RULES: tuple[tuple[str, tuple], ...] = (
    (rf"transformer_blocks\.\d+\.{ATTENTIONS}\.(to_[qkv]|to_gate_logits)\.weight$", ("tp", None)),
    (rf"transformer_blocks\.\d+\.{ATTENTIONS}\.(to_[qkv]|to_gate_logits)\.bias$", ("tp",)),
    (rf"transformer_blocks\.\d+\.{ATTENTIONS}\.norm_[qk]\.weight$", ("tp",)),
    (rf"transformer_blocks\.\d+\.{ATTENTIONS}\.to_out\.0\.weight$", (None, "tp")),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.0\.proj\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.0\.proj\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.2\.weight$", (None, "tp")),
)

GEMMA3_RULES: tuple[tuple[str, tuple], ...] = (
    (r"layers\.\d+\.self_attn\.[qkv]_proj\.weight$", ("tp", None)),
    (r"layers\.\d+\.self_attn\.o_proj\.weight$", (None, "tp")),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.weight$", ("tp", None)),
    (r"layers\.\d+\.mlp\.down_proj\.weight$", (None, "tp")),
    (r"embed_tokens\.weight$", (None, "tp")),
)


def connector_rules(prefix: str, heads_split: bool) -> tuple[tuple[str, tuple], ...]:
    """One text connector's blocks (``prefix``: "video_connector", "audio_connector"): Megatron where ``tp``
    divides its heads (``heads_split``), else attention split by input and the feed-forward by Megatron."""
    block = rf"{prefix}\.transformer_blocks\.\d+\.attn1\."
    feed_forward = (
        (rf"{prefix}\.transformer_blocks\.\d+\.ff\.net\.0\.proj\.weight$", ("tp", None)),
        (rf"{prefix}\.transformer_blocks\.\d+\.ff\.net\.0\.proj\.bias$", ("tp",)),
        (rf"{prefix}\.transformer_blocks\.\d+\.ff\.net\.2\.weight$", (None, "tp")),
    )
    if heads_split:
        attention = (
            (rf"{block}(to_[qkv]|to_gate_logits)\.weight$", ("tp", None)),
            (rf"{block}(to_[qkv]|to_gate_logits)\.bias$", ("tp",)),
            (rf"{block}norm_[qk]\.weight$", ("tp",)),
            (rf"{block}to_out\.0\.weight$", (None, "tp")),
        )
    else:
        attention = ((rf"{block}(to_[qkv]|to_out\.0|to_gate_logits)\.weight$", (None, "tp")),)
    return attention + feed_forward


# The input projections from Gemma's stacked states: 2.0's one, 2.3's one per modality.
CONNECTOR_INPUT_RULES: tuple[tuple[str, tuple], ...] = ((r"(^|\.)(video_|audio_)?text_proj_in\.weight$", (None, "tp")),)

RULES = {"text_encoder": GEMMA3_RULES, "transformer": TRANSFORMER_RULES}
