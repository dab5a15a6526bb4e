"""MagCache's published magnitude ratios for the released Wan models, chosen by the loaded model's architecture.

Source: the MagCache authors' repository, https://github.com/Zehong-Ma/MagCache at commit
df81cb181776c2c61477c08e1d21f87fda1cd938 (the same arrays maxdiffusion ships in its Wan configs as
``mag_ratios_base``). Each array below is copied as published there: the calls of a CFG run interleaved
``[cond, uncond, cond, uncond, ...]`` from the second step on (that code prepends ``[1.0] * 2`` for the first
step). diffusers' ``MagCacheConfig`` takes one list per transformer, counted over that transformer's own steps
and used for both CFG passes, starting with the first step's 1.0: ``diffusers_list`` derives it (the
conditional calls; the two passes differ by 0.01 at most in every array here). Wan 2.2 A14B's arrays span both
experts over 40 steps, the high-noise expert's steps first: ``split`` cuts them where the expert changes at the
shift and boundary they were calibrated with, one list per expert, each counted from its own first step as
diffusers' per-transformer hooks count.

A model whose configuration is none of these gets no ratios: ``--mag-ratios`` or ``--cache-calibrate``.
"""

from __future__ import annotations

#: The high-noise expert's steps of the 40 the A14B arrays were calibrated over: T2V at shift 12 and boundary 0.875,
#: I2V at shift 5 and boundary 0.9 (the expert-switch dip in each array sits there: 0.65523, 0.91076).
T2V_A14B_HIGH_STEPS = 26
I2V_A14B_HIGH_STEPS = 15

# MagCache4Wan2.1/magcache_generate.py#L910: 50 steps
WAN21_T2V_14B = (
    1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966, 0.99658, 0.99482, 0.99476,
    0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438, 0.99434,
    0.99516, 0.99517, 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428, 0.99426,
    0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215, 0.99215, 0.99218, 0.99215,
    0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887, 0.98866,
    0.98772, 0.9877, 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177, 0.98173,
    0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711, 0.96708, 0.96349, 0.96345,
    0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796, 0.87945,
    0.86111, 0.86189,
)

# MagCache4Wan2.1/magcache_generate.py#L912: 50 steps
WAN21_T2V_1_3B = (
    1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762, 0.99634, 0.99685, 0.99567, 0.99586,
    0.99416, 0.99422, 0.99578, 0.99575, 0.9957, 0.99563, 0.99511, 0.99506, 0.99535, 0.99531, 0.99552, 0.99549,
    0.99541, 0.99539, 0.9954, 0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481, 0.99479,
    0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386, 0.99349, 0.99349, 0.99309, 0.99304,
    0.9927, 0.9927, 0.99228, 0.99226, 0.99171, 0.9917, 0.99137, 0.99135, 0.99068, 0.99063, 0.99005, 0.99003,
    0.98944, 0.98942, 0.98849, 0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836, 0.98359,
    0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411, 0.97003, 0.97002, 0.96538, 0.96541,
    0.9593, 0.95933, 0.95086, 0.95089, 0.94013, 0.94019, 0.92402, 0.92414, 0.90241, 0.9026, 0.86821, 0.86868,
    0.81838, 0.81939,
)

# MagCache4Wan2.1/magcache_generate.py#L1002: 40 steps
WAN21_I2V_480P = (
    0.98783, 0.98993, 0.97559, 0.97593, 0.98311, 0.98319, 0.98202, 0.98225, 0.9888, 0.98878, 0.98762, 0.98759,
    0.98957, 0.98971, 0.99052, 0.99043, 0.99383, 0.99384, 0.98857, 0.9886, 0.99065, 0.99068, 0.98845, 0.98847,
    0.99057, 0.99057, 0.98957, 0.98961, 0.98601, 0.9861, 0.98823, 0.98823, 0.98756, 0.98759, 0.98808, 0.98814,
    0.98721, 0.98724, 0.98571, 0.98572, 0.98543, 0.98544, 0.98157, 0.98165, 0.98411, 0.98413, 0.97952, 0.97953,
    0.98149, 0.9815, 0.9774, 0.97742, 0.97825, 0.97826, 0.97355, 0.97361, 0.97085, 0.97087, 0.97056, 0.97055,
    0.96588, 0.96587, 0.96113, 0.96124, 0.9567, 0.95681, 0.94961, 0.94969, 0.93973, 0.93988, 0.93217, 0.93224,
    0.91878, 0.91896, 0.90955, 0.90954, 0.92617, 0.92616,
)

# MagCache4Wan2.1/magcache_generate.py#L1004: 40 steps
WAN21_I2V_720P = (
    0.99428, 0.99498, 0.98588, 0.98621, 0.98273, 0.98281, 0.99018, 0.99023, 0.98911, 0.98917, 0.98646, 0.98652,
    0.99454, 0.99456, 0.9891, 0.98909, 0.99124, 0.99127, 0.99102, 0.99103, 0.99215, 0.99212, 0.99515, 0.99515,
    0.99576, 0.99572, 0.99068, 0.99072, 0.99097, 0.99097, 0.99166, 0.99169, 0.99041, 0.99042, 0.99201, 0.99198,
    0.99101, 0.99101, 0.98599, 0.98603, 0.98845, 0.98844, 0.98848, 0.98851, 0.98862, 0.98857, 0.98718, 0.98719,
    0.98497, 0.98497, 0.98264, 0.98263, 0.98389, 0.98393, 0.97938, 0.9794, 0.97535, 0.97536, 0.97498, 0.97499,
    0.973, 0.97301, 0.96827, 0.96828, 0.96261, 0.96263, 0.95335, 0.9534, 0.94649, 0.94655, 0.93397, 0.93414,
    0.91636, 0.9165, 0.89088, 0.89109, 0.8679, 0.86768,
)

# MagCache4Wan2.2/magcache_generate.py#L695: 40 steps
WAN22_T2V_A14B = (
    1.00124, 1.00155, 0.99822, 0.99851, 0.99696, 0.99687, 0.99703, 0.99732, 0.9966, 0.99679, 0.99602, 0.99658,
    0.99578, 0.99664, 0.99484, 0.9949, 0.99633, 0.996, 0.99659, 0.99683, 0.99534, 0.99549, 0.99584, 0.99577,
    0.99681, 0.99694, 0.99563, 0.99554, 0.9944, 0.99473, 0.99594, 0.9964, 0.99466, 0.99461, 0.99453, 0.99481,
    0.99389, 0.99365, 0.99391, 0.99406, 0.99354, 0.99361, 0.99283, 0.99278, 0.99268, 0.99263, 0.99057, 0.99091,
    0.99125, 0.99126, 0.65523, 0.65252, 0.98808, 0.98852, 0.98765, 0.98736, 0.9851, 0.98535, 0.98311, 0.98339,
    0.9805, 0.9806, 0.97776, 0.97771, 0.97278, 0.97286, 0.96731, 0.96728, 0.95857, 0.95855, 0.94385, 0.94385,
    0.92118, 0.921, 0.88108, 0.88076, 0.80263, 0.80181,
)

# MagCache4Wan2.2/magcache_generate.py#L736: 50 steps
WAN22_TI2V_5B_T2V = (
    0.99505, 0.99389, 0.99441, 0.9957, 0.99558, 0.99551, 0.99499, 0.9945, 0.99534, 0.99548, 0.99468, 0.9946,
    0.99463, 0.99458, 0.9946, 0.99453, 0.99408, 0.99404, 0.9945, 0.99441, 0.99409, 0.99398, 0.99403, 0.99397,
    0.99382, 0.99377, 0.99349, 0.99343, 0.99377, 0.99378, 0.9933, 0.99328, 0.99303, 0.99301, 0.99217, 0.99216,
    0.992, 0.99201, 0.99201, 0.99202, 0.99133, 0.99132, 0.99112, 0.9911, 0.99155, 0.99155, 0.98958, 0.98957,
    0.98959, 0.98958, 0.98838, 0.98835, 0.98826, 0.98825, 0.9883, 0.98828, 0.98711, 0.98709, 0.98562, 0.98561,
    0.98511, 0.9851, 0.98414, 0.98412, 0.98284, 0.98282, 0.98104, 0.98101, 0.97981, 0.97979, 0.97849, 0.97849,
    0.97557, 0.97554, 0.97398, 0.97395, 0.97171, 0.97166, 0.96917, 0.96913, 0.96511, 0.96507, 0.96263, 0.96257,
    0.95839, 0.95835, 0.95483, 0.95475, 0.94942, 0.94936, 0.9468, 0.94678, 0.94583, 0.94594, 0.94843, 0.94872,
    0.96949, 0.97015,
)

# MagCache4Wan2.2/magcache_generate.py#L738: 50 steps
WAN22_TI2V_5B_I2V = (
    0.99512, 0.99559, 0.99559, 0.99561, 0.99595, 0.99577, 0.99512, 0.99512, 0.99546, 0.99534, 0.99543, 0.99531,
    0.99496, 0.99491, 0.99504, 0.99499, 0.99444, 0.99449, 0.99481, 0.99481, 0.99435, 0.99435, 0.9943, 0.99431,
    0.99411, 0.99406, 0.99373, 0.99376, 0.99413, 0.99405, 0.99363, 0.99359, 0.99335, 0.99331, 0.99244, 0.99243,
    0.99229, 0.99229, 0.99239, 0.99236, 0.99163, 0.9916, 0.99149, 0.99151, 0.99191, 0.99192, 0.9898, 0.98981,
    0.9899, 0.98987, 0.98849, 0.98849, 0.98846, 0.98846, 0.98861, 0.98861, 0.9874, 0.98738, 0.98588, 0.98589,
    0.98539, 0.98534, 0.98444, 0.98439, 0.9831, 0.98309, 0.98119, 0.98118, 0.98001, 0.98, 0.97862, 0.97859, 0.97555,
    0.97558, 0.97392, 0.97388, 0.97152, 0.97145, 0.96871, 0.9687, 0.96435, 0.96434, 0.96129, 0.96127, 0.95639,
    0.95638, 0.95176, 0.95175, 0.94446, 0.94452, 0.93972, 0.93974, 0.93575, 0.9359, 0.93537, 0.93552, 0.96655,
    0.96616,
)

# MagCache4Wan2.2/magcache_generate.py#L771: 40 steps
WAN22_I2V_A14B = (
    0.99191, 0.99144, 0.99356, 0.99337, 0.99326, 0.99285, 0.99251, 0.99264, 0.99393, 0.99366, 0.9943, 0.9943,
    0.99276, 0.99288, 0.99389, 0.99393, 0.99274, 0.99289, 0.99316, 0.9931, 0.99379, 0.99377, 0.99268, 0.99271,
    0.99222, 0.99227, 0.99175, 0.9916, 0.91076, 0.91046, 0.98931, 0.98933, 0.99087, 0.99088, 0.98852, 0.98855,
    0.98895, 0.98896, 0.98806, 0.98808, 0.9871, 0.98711, 0.98613, 0.98618, 0.98434, 0.98435, 0.983, 0.98307,
    0.98185, 0.98187, 0.98131, 0.98131, 0.9783, 0.97835, 0.97619, 0.9762, 0.97264, 0.9727, 0.97088, 0.97098,
    0.96568, 0.9658, 0.96045, 0.96055, 0.95322, 0.95335, 0.94579, 0.94594, 0.93297, 0.93311, 0.91699, 0.9172,
    0.89174, 0.89202, 0.8541, 0.85446, 0.79823, 0.79902,
)


def diffusers_list(published: tuple[float, ...]) -> tuple[float, ...]:
    """One list as diffusers' MagCacheConfig takes it: the first step's 1.0, then the conditional calls'."""
    return (1.0,) + tuple(published[0::2])


def split(published: tuple[float, ...], high_steps: int) -> dict[str, tuple[float, ...]]:
    """A two-expert array cut where the low-noise expert takes over: one list per transformer."""
    ratios = diffusers_list(published)
    return {"transformer": ratios[:high_steps], "transformer_2": ratios[high_steps:]}


def _key(config: dict, two_experts: bool) -> tuple:
    """What tells the released architectures apart (the I2V 480P and 720P models share one)."""
    return (int(config["num_layers"]), int(config["num_attention_heads"]), int(config["ffn_dim"]),
            int(config["in_channels"]), int(config["out_channels"]), config.get("image_dim") is not None,
            config.get("pos_embed_seq_len"), bool(two_experts))


_T2V_1_3B = (30, 12, 8960, 16, 16, False, None, False)
_T2V_14B = (40, 40, 13824, 16, 16, False, None, False)
_I2V_14B = (40, 40, 13824, 36, 16, True, None, False)
_T2V_A14B = (40, 40, 13824, 16, 16, False, None, True)
_I2V_A14B = (40, 40, 13824, 36, 16, False, None, True)
_TI2V_5B = (30, 24, 14336, 48, 48, False, None, False)


def published(config: dict, two_experts: bool, image: bool, height: int, width: int,
              name: str = "") -> tuple[str, dict[str, tuple[float, ...]]] | None:
    """(which model's ratios, one list per transformer) for a model of this transformer ``config``, or None.
    ``image``: an image-to-video generation (TI2V-5B has one array for each use). The Wan 2.1 I2V 480P and 720P
    models share an architecture: a ``name`` (folder or file) saying 480P or 720P picks that one's; otherwise the
    video size does (720P's from 1280x720's area on)."""
    key = _key(config, two_experts)
    if key == _T2V_1_3B:
        return "Wan2.1-T2V-1.3B", {"transformer": diffusers_list(WAN21_T2V_1_3B)}
    if key == _T2V_14B:
        return "Wan2.1-T2V-14B", {"transformer": diffusers_list(WAN21_T2V_14B)}
    if key == _I2V_14B:
        upper = name.upper()
        big = "720P" in upper if ("720P" in upper) != ("480P" in upper) else height * width >= 1280 * 720
        return (("Wan2.1-I2V-14B-720P", {"transformer": diffusers_list(WAN21_I2V_720P)}) if big else
                ("Wan2.1-I2V-14B-480P", {"transformer": diffusers_list(WAN21_I2V_480P)}))
    if key == _T2V_A14B:
        return "Wan2.2-T2V-A14B", split(WAN22_T2V_A14B, T2V_A14B_HIGH_STEPS)
    if key == _I2V_A14B:
        return "Wan2.2-I2V-A14B", split(WAN22_I2V_A14B, I2V_A14B_HIGH_STEPS)
    if key == _TI2V_5B:
        return (("Wan2.2-TI2V-5B (image to video)", {"transformer": diffusers_list(WAN22_TI2V_5B_I2V)}) if image else
                ("Wan2.2-TI2V-5B (text to video)", {"transformer": diffusers_list(WAN22_TI2V_5B_T2V)}))
    return None
