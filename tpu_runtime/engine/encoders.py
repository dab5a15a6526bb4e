"""The T5-family text encoders two families share: CogVideoX's T5-XXL (google/t5-v1_1-xxl's encoder) and Wan's
umT5-XXL (google/umt5-xxl's encoder): their sharding rule tables and their released configs (``plan``)."""

# torch Linear weights are [out, in]: column parallel = ("tp", None), row parallel = (None, "tp").
# umT5 has T5's names plus a relative-position bias in every layer, split on heads.
T5_ENCODER_RULES: tuple[tuple[str, tuple], ...] = (
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.[qkv]\.weight$", ("tp", None)),
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.o\.weight$", (None, "tp")),
    (r"encoder\.block\.\d+\.layer\.1\.DenseReluDense\.wi(_0|_1)?\.weight$", ("tp", None)),
    (r"encoder\.block\.\d+\.layer\.1\.DenseReluDense\.wo\.weight$", (None, "tp")),
)
UMT5_ENCODER_RULES: tuple[tuple[str, tuple], ...] = T5_ENCODER_RULES + (
    (r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.relative_attention_bias\.weight$", (None, "tp")),
)


# google/t5-v1_1-xxl's encoder, as CogVideoX's text_encoder/config.json has it.
T5_XXL = {
    "architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
    "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0, "is_encoder_decoder": True,
}
# google/umt5-xxl's encoder, as Wan's text_encoder/config.json has it: T5-XXL's shape with a 256k vocabulary and
# a relative-position bias in every layer.
UMT5_XXL = {**T5_XXL, "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 256384,
            "scalable_attention": True}
