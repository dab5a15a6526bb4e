"""ComfyUI's MiniMax H3 diffusion model (``comfy/ldm/minimax/model.py``, ComfyUI 0.33) on the runtime: one program for
every step of a run.

MiniMax H3's ``_forward`` decides a good part of its work from values on the host at every call: the per-token
timesteps (``t = 1 - sigma`` of the video stream, the audio stream's shifted one, the condition rows pinned near 1,
masked rows at their own strength) are Python floats, deduplicated into a table whose row indices become Python
integers of a list of segments, the text span is split into runs by the prompt's modality tags (``.tolist()``), and
the condition latents get noise from a CPU generator seeded with the run's seed. Traced as it is, the first
``float()`` stops it; made constants, every step, seed and prompt would compile a program of its own.

So the forward is split where ComfyUI's own code computes from host values:

- ``prepare`` (on the host, every call): what ComfyUI's ``_forward`` computes from Python values, the same way, into
  arrays: the timestep table (``t_values``: one slot per *kind* of timestep, not per distinct value, so that its
  length is fixed for a run), the text span's per-token rows of the modulation tables (slot * 3 + the token's tag),
  masked rows' slots, the condition rows with ComfyUI's own noise, the token positions of the packed layout.
- ``core`` (the compiled program): the rest of ``_forward`` on those arrays, with ComfyUI's own blocks, final layer,
  RoPE table, time embedder or curve table; segments are the layout's, each modulated by its slot's rows (a Python
  integer, or per-token rows where ComfyUI's rows vary by token).

Duplicate timestep values give duplicate rows of the same embedding, so the numbers are ComfyUI's. The program's
structure is the layout (sizes, which kinds of condition rows, how many distinct mask levels), fixed through a run:
a new seed, prompt (of the same token count) or step compiles nothing. ``preprocess_text_embeds`` (ComfyUI runs the
token refiner once per sampling run, in ``extra_conds``) runs as a program of its own beside it (``connectors.py``).
"""

from __future__ import annotations

import torch

# The kinds of timestep a packed segment runs at; condition rows of both kinds of reference share them.
SLOT_KINDS = ("video", "audio", "text", "cond", "cond_audio")
_SLOT_OF_SEGMENT = {"text": "text", "video": "video", "audio": "audio", "cond": "cond", "ref_img": "cond",
                    "cond_audio": "cond_audio", "ref_audio": "cond_audio"}
# ComfyUI's modality tags of the modulation tables' rows: video 0, text 1, audio 2.
_TAG_OF_SEGMENT = {"text": 1, "video": 0, "audio": 2, "cond": 0, "ref_img": 0, "cond_audio": 2, "ref_audio": 2}


def is_minimax_h3(module: torch.nn.Module) -> bool:
    """ComfyUI's ``MiniMaxH3Model`` (any class of that name in the module's MRO: another pack's subclass too), as the
    rule tables recognise a model."""
    return any(cls.__name__ == "MiniMaxH3Model" for cls in type(module).__mro__)


def _model_code(module):
    import importlib

    return importlib.import_module(type(module).__module__)


def prepare(module, x, timestep, context, transformer_options=None, minimax_payload=None, denoise_mask=None,
            audio_denoise_mask=None, **kwargs) -> dict:
    """The arguments of ``core`` for one call of ComfyUI's ``_forward`` (its own computation of every host value)."""
    import comfy.ldm.common_dit

    code = _model_code(module)
    options = transformer_options if transformer_options is not None else {}
    video_x, audio_x = x[0], x[1]
    orig = tuple(video_x.shape[2:])
    video_x = comfy.ldm.common_dit.pad_to_patch_size(video_x, module.patch_size)
    if video_x.shape[0] != 1:
        raise ValueError("MiniMax H3 supports batch size 1")
    payload = minimax_payload or {}
    latent_t, lat_h, lat_w = (int(s) for s in video_x.shape[2:])
    audio_t, text_len = int(audio_x.shape[-1]), int(context.shape[1])
    layout = payload.get("layout")
    if layout is None or layout.signature != (text_len, latent_t, lat_h, lat_w, audio_t):
        layout = code.PackedLayout(text_len, latent_t, lat_h, lat_w, audio_t, keyframes=payload.get("keyframes"),
                                   refs=payload.get("refs"))

    shift_v = float(options.get("minimax_h3_sigma_shift_video", module.sigma_shift_video))
    shift_a = float(options.get("minimax_h3_sigma_shift_audio", module.sigma_shift_audio))
    sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
    t_v = float(1.0 - sigma_v)
    t_a = float(1.0 - code.time_shift_sigma(sigma_v, shift_v, shift_a))
    vis_aug = float(payload.get("visual_cond_noise_aug", code.VISUAL_COND_TIMESTEP))
    aud_aug = float(payload.get("audio_cond_noise_aug", code.AUDIO_COND_TIMESTEP))
    values = {"video": t_v, "audio": t_a, "text": t_v, "cond": max(t_v, vis_aug), "cond_audio": max(t_a, aud_aug)}

    # masked rows at their own strength (ComfyUI: 1 - m * sigma, clamped at the condition timestep)
    levels: dict[str, torch.Tensor] = {}
    row_level: dict[str, torch.Tensor] = {}
    if denoise_mask is not None:
        m = code.mask_row_values(denoise_mask[0, 0].to(torch.float32), latent_t, lat_h, lat_w)
        if m is not None:
            pin_v = max(t_v, code.VISUAL_COND_TIMESTEP)
            levels["video"], row_level["video"] = _levels(m, lambda v: (1.0 - v * sigma_v).clamp(max=pin_v))
    if audio_denoise_mask is not None:
        m = audio_denoise_mask[0, 0].to(torch.float32).reshape(-1)
        if not bool((m >= 1.0 - 1e-3).all()):
            pin_a = max(t_a, code.AUDIO_COND_TIMESTEP)
            levels["audio"], row_level["audio"] = _levels(m, lambda v: (1.0 - v * (1.0 - t_a)).clamp(max=pin_a))

    kinds = {_SLOT_OF_SEGMENT[kind] for _, _, kind in layout.segments} | {"video", "audio"}
    slots = [k for k in SLOT_KINDS if k in kinds]
    slot = {k: i for i, k in enumerate(slots)}
    t_values = [values[k] for k in slots]
    level_base = {}
    for stream in ("video", "audio"):
        if stream in levels:
            level_base[stream] = len(t_values)
            t_values += [float(v) for v in levels[stream]]

    tags = payload.get("text_token_tags")
    segments, per_token = [], {}
    for a, b, kind in layout.segments:
        tag = _TAG_OF_SEGMENT[kind]
        if kind == "text" and tags is not None:
            per_token["text_rows"] = slot["text"] * 3 + tags.view(-1)[: b - a].to(torch.int32)
            segments.append((a, b, kind, "text_rows"))
        elif kind in ("video", "audio") and kind in level_base:
            per_token[f"{kind}_rows"] = (level_base[kind] + row_level[kind]) * 3 + tag
            segments.append((a, b, kind, f"{kind}_rows"))
        else:
            segments.append((a, b, kind, slot[_SLOT_OF_SEGMENT[kind]] * 3 + tag))
    final = tuple(f"{stream}_levels" if stream in level_base else slot[stream] for stream in ("video", "audio"))
    for stream in ("video", "audio"):
        if stream in level_base:
            per_token[f"{stream}_levels"] = (level_base[stream] + row_level[stream]).to(torch.int32)

    return {
        "video_x": video_x, "audio_x": audio_x, "context": context,
        "cond_video_rows": module._cond_video_rows(payload, "cpu"),
        "cond_audio_rows": module._cond_audio_rows(payload, "cpu"),
        "t_values": torch.tensor(t_values, dtype=torch.float32),
        "position_ids": layout.position_ids.to(torch.float32),
        "rows": {k: v.to(torch.int32) for k, v in per_token.items()},
        "plan": (tuple(segments), final, orig, layout.seq_len),
        "transformer_options": options,
    }


def _levels(mask_values: torch.Tensor, timestep_of) -> tuple[list[float], torch.Tensor]:
    """The timesteps of masked rows, one level per distinct mask value (fixed through a run, so the table's length
    is), and each row's level. ``timestep_of``: ComfyUI's elementwise ``rows_t`` of mask values (the same float32
    arithmetic on the same values as its per-row computation)."""
    distinct, index = torch.unique(mask_values, return_inverse=True)
    return [float(v) for v in timestep_of(distinct)], index.to(torch.int32)


def core(module, video_x, audio_x, context, cond_video_rows, cond_audio_rows, t_values, position_ids, rows, plan,
         transformer_options={}):  # noqa: B006 - ComfyUI's convention for the options' default
    """ComfyUI's ``_forward`` after its host values (``prepare``): embed, modulate every segment by its slot's rows,
    the blocks, the final layer. Compiled once per layout."""
    code = _model_code(module)
    segments, (video_final, audio_final), (orig_t, orig_h, orig_w), seq_len = plan
    dtype = context.dtype
    latent_t, lat_h, lat_w = video_x.shape[2], video_x.shape[3], video_x.shape[4]

    def row_of(spec):
        return rows[spec] if isinstance(spec, str) else spec

    mod_segments = [(a, b, row_of(spec)) for a, b, _, spec in segments]

    video_rows = code.patchify_video(video_x.to(torch.float32), module.patch_size)
    audio_rows = code.pack_audio(audio_x.to(torch.float32))
    # condition rows come first among the rows of their kind (keyframes and references pack before the targets)
    if cond_video_rows is not None:
        video_rows = torch.cat([cond_video_rows, video_rows], dim=0)
    if cond_audio_rows is not None:
        audio_rows = torch.cat([cond_audio_rows, audio_rows], dim=0)
    video_embed = module.video_patch_proj(video_rows).to(dtype)
    audio_embed = module.audio_patch_proj(audio_rows).to(dtype)
    text_states = context[0]
    if text_states.shape[-1] != module.hidden_size:
        text_states = module.token_refiner(module.condition_proj(text_states), transformer_options=transformer_options)

    pieces, video_at, audio_at = [], 0, 0
    for a, b, kind, _ in segments:  # contiguous, in order: each takes the next rows of its stream
        n = b - a
        if kind == "text":
            pieces.append(text_states)
        elif _TAG_OF_SEGMENT[kind] == 0:
            pieces.append(video_embed[video_at:video_at + n])
            video_at += n
        else:
            pieces.append(audio_embed[audio_at:audio_at + n])
            audio_at += n
    h = torch.cat(pieces, dim=0)

    if module.use_adaln_curves:
        import comfy.model_management

        table = comfy.model_management.cast_to(module.adaln_t_table, device=h.device)
        pos = t_values.clamp(0.0, 1.0) * (table.shape[0] - 1)
        i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
        t_emb = torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
    else:
        t_emb = module.time_embedder(t_values).to(dtype)

    rope_freqs = code.rope_rotation_table(module.rope_freqs(position_ids, h.device), dtype)

    blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
    for i, block in enumerate(module.blocks):
        if ("double_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                     transformer_options=args["transformer_options"])}
            h = blocks_replace[("double_block", i)](
                {"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope_freqs,
                 "transformer_options": transformer_options}, {"original_block": block_wrap})["img"]
        else:
            h = block(h, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)

    (va, vb), (aa, ab) = ((next((a, b) for a, b, kind, _ in segments if kind == stream)) for stream in ("video", "audio"))
    v, a = module.final_layer(h, t_emb, (va, vb, row_of(video_final)), (aa, ab, row_of(audio_final)))
    video_out = code.unpatchify_video(v, latent_t, lat_h // 2, lat_w // 2, module.latents_dim, module.patch_size)
    video_out = video_out[:, :, :orig_t, :orig_h, :orig_w]
    audio_out = code.unpack_audio(a)
    return [-video_out.to(video_x.dtype), -audio_out.to(audio_x.dtype)]
