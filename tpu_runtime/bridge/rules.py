"""Where a bridged model's weights go on the mesh: rule tables written as data in ComfyUI's own module names.

An architecture is recognised by its class (any class in the model's MRO named in ``classes``: VACE, Animate, S2V,
HuMo and Camera models are ``WanModel``s), and its weights placed as our families place theirs (Megatron: q/k/v and
the first feed-forward projection split on their output dimension over ``tp``, the attention output and the
second feed-forward projection on their input dimension). A model no table names gets ``GENERIC``: every large
matrix split along one dimension that ``tp`` divides. Any placement is correct on any mesh (XLA moves data where
a computation needs it); a good one only moves less.

Sequence parallelism needs no rule: attention splits its queries over ``sp`` (``engine/attention.py``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from ..engine.sharding import MeshSpec, spec_for
from ..errors import InputError

log = logging.getLogger(__name__)

COLUMN, ROW, VECTOR = ("tp", None), (None, "tp"), ("tp",)
GENERIC_MIN_ELEMENTS = 1 << 20  # matrices smaller than this stay whole on every device


@dataclass(frozen=True)
class ArchRules:
    """One architecture's placement: ``weights`` (regex on the parameter name -> PartitionSpec, first match wins;
    unmatched tensors are replicated, or split by the generic rule when ``generic``), the classes it is for and
    where its attention head count is read."""

    name: str
    classes: tuple[str, ...] = ()
    weights: tuple[tuple[str, tuple], ...] = ()
    heads: tuple[str, ...] = ("num_heads", "heads", "num_attention_heads", "n_heads")
    generic: bool = False
    heads_in_submodules: bool = False  # the head count is an attribute of the attention layers (text encoders)

    def matches(self, module: torch.nn.Module) -> bool:
        names = {cls.__name__ for cls in type(module).__mro__}
        return any(name in names for name in self.classes)

    def head_count(self, module: torch.nn.Module) -> int | None:
        for sub in module.modules() if self.heads_in_submodules else (module,):
            for attr in self.heads:
                value = getattr(sub, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    def auto_mesh(self, module: torch.nn.Module, devices: int) -> MeshSpec:
        """Attention heads over as many devices as divide them (tp), the rest on sp (queries split in attention).
        The CFG batch stays whole: a sampler may call with one prompt or two, and dp would idle on one."""
        heads = self.head_count(module) or 1
        tp = max(d for d in range(1, devices + 1) if devices % d == 0 and heads % d == 0)
        return MeshSpec(dp=1, sp=devices // tp, tp=tp)

    def check_mesh(self, module: torch.nn.Module, spec: MeshSpec, devices: int) -> None:
        if spec.devices != devices:
            raise InputError(f"mesh {spec} uses {spec.devices} devices but {devices} are available: choose sizes "
                             f"whose product is {devices} (or mesh auto)")
        heads = self.head_count(module)
        if heads and heads % spec.tp:
            ok = [d for d in range(1, devices + 1) if devices % d == 0 and heads % d == 0]
            raise InputError(f"mesh axis tp={spec.tp} does not divide {type(module).__name__}'s {heads} attention "
                             f"heads: use tp in {ok} (or mesh auto)")

    def describe(self) -> str:
        return f"{self.name} placement rules" if not self.generic else "generic placement"


def _attention(prefix: str, qkv: str, out: str, norms: str = "") -> tuple[tuple[str, tuple], ...]:
    rules = [(rf"{prefix}\.({qkv})\.weight$", COLUMN), (rf"{prefix}\.({qkv})\.bias$", VECTOR),
             (rf"{prefix}\.({out})\.weight$", ROW)]
    if norms:
        rules.append((rf"{prefix}\.({norms})\.weight$", VECTOR))
    return tuple(rules)


def _mlp(prefix: str, first: str, second: str) -> tuple[tuple[str, tuple], ...]:
    return ((rf"{prefix}\.{first}\.weight$", COLUMN), (rf"{prefix}\.{first}\.bias$", VECTOR),
            (rf"{prefix}\.{second}\.weight$", ROW))


# ComfyUI's comfy/ldm/wan/model.py (and model_animate.py): blocks.N.self_attn / cross_attn (q, k, v, o; the I2V
# image k_img / v_img; RMS norms over all heads follow q/k's split), blocks.N.ffn (0, 2); VACE's vace_blocks; S2V's
# audio cross-attention (audio_injector.injector.N); Animate's face fuser blocks.
WAN = ArchRules(
    name="Wan",
    classes=("WanModel",),
    weights=(
        *_attention(r"(blocks|vace_blocks)\.\d+\.(self_attn|cross_attn)", "q|k|v|k_img|v_img", "o",
                    "norm_q|norm_k|norm_k_img"),
        *_mlp(r"(blocks|vace_blocks)\.\d+\.ffn", "0", "2"),
        *_attention(r"audio_injector\.injector\.\d+", "q|k|v", "o", "norm_q|norm_k"),
        (r"face_adapter\.fuser_blocks\.\d+\.(linear1_kv|linear1_q)\.weight$", COLUMN),
        (r"face_adapter\.fuser_blocks\.\d+\.(linear1_kv|linear1_q)\.bias$", VECTOR),
        (r"face_adapter\.fuser_blocks\.\d+\.linear2\.weight$", ROW),
    ),
)

# comfy/ldm/hunyuan_video/model.py (Flux-style layers): double_blocks.N.{img,txt}_attn.qkv / proj,
# {img,txt}_mlp.0 / .2, {img,txt}_mod.lin; single_blocks.N.linear1 (qkv and MLP in), linear2, modulation.lin; the
# text refiner's blocks (txt_in.individual_token_refiner.blocks.N.self_attn.qkv / proj, mlp.0 / .2). HunyuanVideo 1.5
# is the same class (double blocks only, 2048 wide, 16 heads): its ByT5 and SigLIP projections are small, whole.
HUNYUAN_VIDEO = ArchRules(
    name="HunyuanVideo",
    classes=("HunyuanVideo",),
    weights=(
        *_attention(r"double_blocks\.\d+\.(img|txt)_attn", "qkv", "proj"),
        *_mlp(r"double_blocks\.\d+\.(img|txt)_mlp", "0", "2"),
        # the modulations (6 x hidden wide, a third of HunyuanVideo 1.5's weights) split on their input: each chip
        # sums its part of the small modulation vector (one all-reduce); split on their output, the vector's parts
        # were gathered again before every use (a reduced 1.5 step for v6e-8: 23 all-gathers and 105
        # collective-permutes against 7 and 0, and 38% less temporary memory, for the same weights per chip)
        (r"double_blocks\.\d+\.(img|txt)_mod\.lin\.weight$", ROW),
        (r"single_blocks\.\d+\.modulation\.lin\.weight$", ROW),
        (r"single_blocks\.\d+\.linear1\.weight$", COLUMN),
        (r"single_blocks\.\d+\.linear1\.bias$", VECTOR),
        (r"single_blocks\.\d+\.linear2\.weight$", ROW),
        *_attention(r"txt_in\.individual_token_refiner\.blocks\.\d+\.self_attn", "qkv", "proj"),
        *_mlp(r"txt_in\.individual_token_refiner\.blocks\.\d+\.mlp", "0", "2"),
    ),
    heads=("num_heads",),
)

# comfy/ldm/lightricks/model.py: transformer_blocks.N.attn1 / attn2 (to_q, to_k, to_v, to_out.0; q_norm / k_norm
# over all heads), ff.net.0.proj / ff.net.2.
LTXV = ArchRules(
    name="LTX-Video",
    classes=("LTXVModel",),
    weights=(
        *_attention(r"transformer_blocks\.\d+\.attn[12]", "to_q|to_k|to_v", r"to_out\.0", "q_norm|k_norm"),
        *_mlp(r"transformer_blocks\.\d+\.ff\.net", r"0\.proj", "2"),
    ),
    heads=("num_attention_heads", "num_heads"),
)

# comfy/ldm/lightricks/av_model.py (LTX-2, ComfyUI 0.33): the video and the audio stream in each block,
# transformer_blocks.N.{attn1, attn2} (video self and text attention), {audio_attn1, audio_attn2} (audio), and the
# two streams' attention to each other (audio_to_video_attn, video_to_audio_attn): to_q, to_k, to_v, to_out.0, q_norm
# / k_norm over all heads; ff / audio_ff (net.0.proj, net.2). The text connectors ({video,audio}_embeddings_connector:
# transformer_1d_blocks.N.attn1 / ff, the prompt's own attention before sampling) alike. Listed before LTX-Video:
# LTXAVModel is an LTXVModel.
LTXAV = ArchRules(
    name="LTX-2",
    classes=("LTXAVModel",),
    weights=(
        *_attention(r"transformer_blocks\.\d+\.(attn[12]|audio_attn[12]|audio_to_video_attn|video_to_audio_attn)",
                    "to_q|to_k|to_v", r"to_out\.0", "q_norm|k_norm"),
        *_mlp(r"transformer_blocks\.\d+\.(ff|audio_ff)\.net", r"0\.proj", "2"),
        *_attention(r"(video|audio)_embeddings_connector\.transformer_1d_blocks\.\d+\.attn1", "to_q|to_k|to_v",
                    r"to_out\.0", "q_norm|k_norm"),
        *_mlp(r"(video|audio)_embeddings_connector\.transformer_1d_blocks\.\d+\.ff\.net", r"0\.proj", "2"),
    ),
    heads=("num_attention_heads", "num_heads"),
)

# comfy/ldm/minimax/model.py (ComfyUI 0.33): blocks.N.attn (qkv_proj fused, out_proj; its q/k norms are one head
# wide, whole), blocks.N.mlp (fc1: gate and up fused, fc2), the per-block adaLN (adaln_proj.linear: three modalities'
# six modulations, 18 x 5376 wide, split on its input like HunyuanVideo's: one small all-reduce instead of gathers), the
# token refiner's blocks alike, the final layer's adaLN.
MINIMAX_H3 = ArchRules(
    name="MiniMax H3",
    classes=("MiniMaxH3Model",),
    weights=(
        *_attention(r"(blocks|token_refiner\.blocks)\.\d+\.attn", "qkv_proj", "out_proj"),
        *_mlp(r"(blocks|token_refiner\.blocks)\.\d+\.mlp", "fc1", "fc2"),
        (r"(blocks\.\d+|final_layer)\.adaln_proj\.linear\.weight$", ROW),
    ),
    heads_in_submodules=True,
)

KNOWN: tuple[ArchRules, ...] = (WAN, HUNYUAN_VIDEO, LTXAV, LTXV, MINIMAX_H3)
GENERIC = ArchRules(name="generic", generic=True)

# Text encoders, in the names of ComfyUI's text models (the ``transformer`` of an SDClipModel). Heads are read from
# the attention layers. The input embedding stays on the host while ComfyUI passes embeddings (``bridge/text.py``).
# comfy/text_encoders/t5.py (umT5-XXL, T5-XXL): encoder.block.N.layer.0.SelfAttention (q, k, v, o),
# layer.1.DenseReluDense (wi or gated wi_0 / wi_1, wo).
T5 = ArchRules(
    name="T5",
    classes=("T5",),
    weights=(
        *_attention(r"encoder\.block\.\d+\.layer\.0\.SelfAttention", "q|k|v", "o"),
        *_mlp(r"encoder\.block\.\d+\.layer\.1\.DenseReluDense", "(wi|wi_0|wi_1)", "wo"),
    ),
    heads=("num_heads",),
    heads_in_submodules=True,
)

# comfy/text_encoders/llama.py (LLaMA 3 of HunyuanVideo, Qwen 2.5, Gemma 2/3): model.layers.N.self_attn (q_proj,
# k_proj, v_proj with GQA's fewer k/v heads, o_proj), mlp (gate_proj, up_proj, down_proj).
LLAMA = ArchRules(
    name="LLaMA",
    classes=("BaseLlama", "Llama2_"),
    weights=(
        *_attention(r"model\.layers\.\d+\.self_attn", "q_proj|k_proj|v_proj", "o_proj"),
        *_mlp(r"model\.layers\.\d+\.mlp", "(gate_proj|up_proj)", "down_proj"),
    ),
    heads=("num_heads",),
    heads_in_submodules=True,
)

# comfy/clip_model.py (CLIP-L/G text): text_model.encoder.layers.N.self_attn (q_proj, k_proj, v_proj, out_proj),
# mlp (fc1, fc2).
CLIP_TEXT = ArchRules(
    name="CLIP text",
    classes=("CLIPTextModel", "CLIPTextModel_"),
    weights=(
        *_attention(r"text_model\.encoder\.layers\.\d+\.self_attn", "q_proj|k_proj|v_proj", "out_proj"),
        *_mlp(r"text_model\.encoder\.layers\.\d+\.mlp", "fc1", "fc2"),
    ),
    heads=("heads",),
    heads_in_submodules=True,
)

TEXT_KNOWN: tuple[ArchRules, ...] = (T5, LLAMA, CLIP_TEXT)
TEXT_GENERIC = ArchRules(name="generic", generic=True, heads_in_submodules=True)


def text_rules_for(module: torch.nn.Module) -> ArchRules:
    """The rule table for a text model, or the generic placement (heads read from its attention layers)."""
    for rules in TEXT_KNOWN:
        if rules.matches(module):
            return rules
    return TEXT_GENERIC


def rules_for(module: torch.nn.Module) -> ArchRules:
    """The rule table for ``module``'s architecture, or ``GENERIC`` (logged once per class)."""
    for rules in KNOWN:
        if rules.matches(module):
            return rules
    name = type(module).__qualname__
    if name not in _announced:
        _announced.add(name)
        log.info("%s has no sharding rules: generic placement (each weight matrix of %d or more elements split "
                 "along one dimension the tp axis divides)", name, GENERIC_MIN_ELEMENTS)
    return GENERIC


_announced: set[str] = set()


def generic_spec(shape: tuple[int, ...], tp: int) -> tuple:
    """A large matrix split over tp along its largest dimension that tp divides; anything else whole."""
    if tp <= 1 or len(shape) < 2 or _numel(shape) < GENERIC_MIN_ELEMENTS:
        return ()
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[i] % tp == 0:
            return tuple("tp" if j == i else None for j in range(len(shape)))
    return ()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def placement_specs(named_shapes: dict[str, tuple[int, ...]], rules: ArchRules, mesh_sizes: dict[str, int],
                    label: str = "") -> dict[str, tuple]:
    """The PartitionSpec (a tuple) of every tensor: the first matching rule, else the generic split for a model
    without rules (replicated for one with rules); axes that do not divide a dimension are dropped."""
    specs = {}
    for name, shape in named_shapes.items():
        spec = spec_for(name, rules.weights)
        if not spec and rules.generic:
            spec = generic_spec(shape, mesh_sizes.get("tp", 1))
        specs[name] = tuple(axis if axis is not None and len(shape) > i and shape[i] % mesh_sizes.get(axis, 1) == 0
                            else None for i, axis in enumerate(spec))
    return specs


def rule_coverage(named_shapes: dict[str, tuple[int, ...]], rules: ArchRules) -> dict[str, int]:
    """How many elements the rules split and how many they leave whole (for plan's report and the tests)."""
    split = whole = 0
    for name, shape in named_shapes.items():
        if spec_for(name, rules.weights) or (rules.generic and generic_spec(shape, 2)):
            split += _numel(shape)
        else:
            whole += _numel(shape)
    return {"split": split, "whole": whole}


def known_rule_names() -> list[str]:
    return [r.name for r in KNOWN]


def _check_patterns() -> None:
    for rules in KNOWN + TEXT_KNOWN:
        for pattern, _ in rules.weights:
            re.compile(pattern)


_check_patterns()
