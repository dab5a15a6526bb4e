"""LTX-2's sharding rule tables (see ``engine/sharding.py``). Every attention of a transformer block — the video
and the sound self-attention (attn1, audio_attn1), their text cross-attention (attn2, audio_attn2) and the two
cross-modal ones (audio_to_video_attn, video_to_audio_attn) — and both feed-forwards are Megatron-split over ``tp``:
q/k/v and the first projection by output, the attention output and the second projection by input, so each needs
one all-reduce. The q/k RMS norms span all heads and follow q/k; 2.3's per-head gates follow the heads. Gemma 3's
decoder layers the same way (its 8 key/value heads split as far as they go). The connectors, the VAEs, the
vocoder and the upsampler are small and stay whole."""

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
)

RULES = {"text_encoder": GEMMA3_RULES, "transformer": TRANSFORMER_RULES}
