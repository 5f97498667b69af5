"""What the sm90 and sm100 bodies of the routed experts share: the launch (read from each body's tuning.json
section), the checks that do not depend on the MMA, the swizzled tile layouts, the per-row scale loads and the
GLU between the two kernels."""

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.moe import grouping
from pallas_kernels.policy import SCALE_MAX_UNKNOWN

UP_BLOCK = 256  # codes bytes per K step of W1/W3: its scale tile [64, 16] is the TMA's 16-byte minimum
W1_ROWS = 64  # W1 / W3 rows per gate/up tile (sm100 stacks W1's over W3's into its 128-row MMA)
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a 64-row WGMMA-layout fragment


@dataclasses.dataclass(frozen=True)
class Launch:
    tokens_per_tile: int  # the MMA's N: a group's tokens per tile (sm90: 8..64 in 8s; sm100: 16..64 in 16s)
    up_steps: int  # pipeline stages in flight in the gate/up kernel
    down_steps: int  # ... in the down kernel
    up_splits: int = 1  # CTAs sharing one gate/up tile's K (a divisor of its L / 512 steps)
    down_row_blocks: int = 1  # W2 row blocks (the body's MMA M) one down CTA streams (a divisor of L / M)
    split_groups: bool = False  # a group larger than a tile on as many CTAs (group_by_expert piece_rows)
    mma_overlap: bool = False  # sm90: a chunk's decode overlaps the previous chunk's WGMMA (wgmma_wait(1))
    direct: bool = False  # up to tokens_per_tile tokens: no grouping, every pair its own slot (is_direct)
    fused_glu: bool = False  # up_splits 1: SiTU-GLU in the gate/up kernel, which writes h (no partials)
    scale_fold: bool = False  # sm90: one bf16x2 multiply a weight pair (scale bytes <= FOLD_MAX_SCALE only)


FOLD_MAX_SCALE = 128  # scale_fold's one factor 2^126 x 2^(e - 127) = 2^(e - 1) is a bf16 for e <= 128


def pick_launch(tuning: dict, arch: str, T: int, scale_max: int = SCALE_MAX_UNKNOWN) -> Launch:
    """tuning.json's `arch` launch for T tokens: the first entry whose max_tokens covers T, scale_fold kept only
    where the experts' largest scale byte (scale_max: the decode policy's expert_scale_max) allows it."""
    entries = tuning[arch]["launch"]
    entry = next((e for e in entries if T <= e["max_tokens"]), None)
    if entry is None:
        raise NotImplementedError(
            f"T = {T} tokens: no {arch} routed-experts launch in tuning.json (it serves up to "
            f"{entries[-1]['max_tokens']})"
        )
    fields = {f.name for f in dataclasses.fields(Launch)}
    launch = Launch(**{k: v for k, v in entry.items() if k in fields})
    return dataclasses.replace(launch, scale_fold=launch.scale_fold and scale_max <= FOLD_MAX_SCALE)


def is_direct(T: int, launch: Launch) -> bool:
    """The pairs as slots, ungrouped (launch `direct`, up to a tile of tokens): slot p = pair p (token p // k's
    choice p % k), the gate/up tile's tokens every token of the step (z itself, padded to one tile: no
    pair_rows copy), column p // k of it kept, pair p's rows at row p (compact: the down kernel's h tile at row
    p reads the next pairs' rows too, whose columns it never stores; h carries tokens_per_tile - 1 zero rows
    past the last pair, padded inside the GLU's fusion, so no pad kernel runs). No XLA grouping kernels and no
    pair_rows launch (3.2 us at T = 1, ~8 us at T = 2-8: bench/results/moe_layer.json); an expert two tokens
    chose is read twice (at T = 8 ~7% more bytes, the second read mostly from L2)."""
    return launch.direct and T <= launch.tokens_per_tile


def group(sel_Tk, num_experts: int, launch: Launch) -> grouping.Groups:
    """The pairs grouped by expert, the slot table in tile-sized pieces where the launch says so (split_groups);
    direct (is_direct): each pair its own slot, at row p (grouping.pair_slots, align 1)."""
    if is_direct(sel_Tk.shape[0], launch):
        return grouping.pair_slots(sel_Tk, align=1)
    piece_rows = launch.tokens_per_tile if launch.split_groups else None
    return grouping.group_by_expert(sel_Tk, num_experts, piece_rows)


def direct_k(sel_Tk, launch: Launch) -> int:
    """The kernels' static direct_k: k where the pairs are the slots (is_direct), else 0."""
    T, k = sel_Tk.shape
    return k if is_direct(T, launch) else 0


def num_rows(T: int, k: int, num_experts: int, launch: Launch) -> int:
    """Rows of the kernels' pair order: a row a pair in the direct form, the grouping's otherwise."""
    return T * k if is_direct(T, launch) else grouping.num_rows(T, k, num_experts)


def slot(table_ref, s, direct_k: int):
    """Slot s's (expert, first row in pair order, size) from the kernels' table: the grouping's [3, S] slot
    table, or (direct_k) the choices sel [1, T k] themselves: pair s at row s, a group of one."""
    if direct_k:
        return table_ref[0, s], s, 1
    return table_ref[0, s], table_ref[1, s], table_ref[2, s]


def slot_table(sel_Tk, groups: grouping.Groups, launch: Launch):
    """The table the kernels walk (slot): sel itself, [1, T k], where the pairs are the slots, else the
    grouping's slots (no XLA kernel stacks a table for the direct form)."""
    T, k = sel_Tk.shape
    return sel_Tk.reshape(1, T * k).astype(jnp.int32) if is_direct(T, launch) else groups.slots_3S


def token_rows(z_TL, groups: grouping.Groups, k: int, num_experts: int, launch: Launch, *, interpret=None):
    """The rows the gate/up kernel's token tiles read: the direct form's (is_direct) tile is every token, z
    padded to a tile, read as it is; grouped, z copied to its pairs' rows (grouping.pair_rows)."""
    T = z_TL.shape[0]
    if is_direct(T, launch):
        return jnp.pad(z_TL, ((0, launch.tokens_per_tile - T), (0, 0)))
    return grouping.pair_rows(z_TL, groups, k, num_experts, interpret=interpret)


def pad_rows(rows: int, direct_k: int, launch: Launch) -> int:
    """The zero rows h carries past the direct form's last pair: its h tile at row P - 1 reads a tile's rows,
    and the TMA takes whole 8-row tiles (Mosaic refuses an array of 23 rows)."""
    if not direct_k:
        return 0
    return -(-(rows + launch.tokens_per_tile - 1) // grouping.ALIGN) * grouping.ALIGN - rows


def pad_direct_partials(part, pad_rows: int):
    """The gate/up partials [..., P, I] with pad_rows zero rows after the last pair (the direct form's h tile at
    row P - 1 reads that far; SiTU-GLU(0, 0) = 0). Padded before the split sum, so that XLA reads the pad inside
    the GLU's fusion: a pad of its output was a kernel of its own (1.2 us at T = 1,
    bench/results/rank_slice_h100_after.json)."""
    if not pad_rows:
        return part
    return jnp.pad(part, [(0, 0)] * (part.ndim - 2) + [(0, pad_rows), (0, 0)])


def ungroup(y_RL, groups: grouping.Groups, T: int, k: int, launch: Launch):
    """The down kernel's rows [R, L] -> [T, k, L] in (token, choice) order: the direct form's rows as they are,
    the grouping's row_P gather otherwise."""
    if is_direct(T, launch):
        return y_RL.reshape(T, k, *y_RL.shape[1:])
    return grouping.ungroup(y_RL, groups, T, k)


def expert_shapes(experts):
    """(E, I, L) of MXFP4 experts: w1 codes [E, I, L/2]."""
    E, I, L2 = experts["w1_codes"].shape
    return E, I, 2 * L2


def check_shapes(experts, z_TL, sel_Tk, launch: Launch, *, down_rows: int):
    """NotImplementedError for inputs neither body takes: dense experts, non-bf16 activations, shapes that do not
    match, a latent width the K steps, the K split or the W2 row blocks of down_rows do not tile, the GLU in the
    gate/up kernel of a split K."""
    if "w1_codes" not in experts:
        raise NotImplementedError("dense (bf16) experts: the kernel reads MXFP4 codes + scales")
    if z_TL.dtype != jnp.bfloat16:
        raise NotImplementedError(f"z is {z_TL.dtype}: the kernels take bf16 activations (bf16 MMAs)")
    E, I, L = expert_shapes(experts)
    T, k = sel_Tk.shape
    if T == 0:
        raise NotImplementedError("no tokens")
    if z_TL.shape != (T, L):
        raise NotImplementedError(f"z {list(z_TL.shape)} does not match the experts' latent width {L}")
    for name, shape in (("w3", (E, I, L // 2)), ("w2", (E, L, I // 2))):
        if experts[name + "_codes"].shape != shape:
            raise NotImplementedError(f"{name}_codes {experts[name + '_codes'].shape}: expected {shape}")
    if (L // 2) % UP_BLOCK:
        raise NotImplementedError(f"latent width {L}: W1/W3 stream in {UP_BLOCK}-byte K steps (L % 512 == 0)")
    if launch.fused_glu and launch.up_splits != 1:
        raise NotImplementedError(f"fused_glu with up_splits {launch.up_splits}: the GLU needs a row's whole K sum")
    if ((L // 2) // UP_BLOCK) % launch.up_splits:
        raise NotImplementedError(f"up_splits {launch.up_splits} does not divide the {L // 2 // UP_BLOCK} K steps")
    if I % W1_ROWS:
        raise NotImplementedError(f"intermediate {I}: W1 / W3 stream in 64-row blocks, W2 in 64-element K chunks")
    if L % (down_rows * launch.down_row_blocks):
        raise NotImplementedError(f"latent width {L} is not a multiple of {launch.down_row_blocks} x {down_rows} rows")


def x_swizzle(k_elems: int) -> int:
    """The widest swizzle (bytes) whose bf16 row (swizzle / 2 elements) divides k: the x tiles' layout."""
    for sw in (128, 64, 32):
        if k_elems % (sw // 2) == 0:
            return sw
    raise NotImplementedError(f"K = {k_elems} elements is not a multiple of 16")


def codes_swizzle(k_bytes: int) -> int:
    """The widest swizzle whose row divides a codes tile's k_bytes (96 -> 32, 192 -> 64, 256 -> 128)."""
    for sw in (128, 64, 32):
        if k_bytes % sw == 0:
            return sw
    raise NotImplementedError(f"a codes tile of {k_bytes} bytes per row is not a multiple of 32")


def tiled(sw: int, elem_bytes: int = 2):
    """The TMA-tiled, swizzled SMEM layout of rows of sw bytes."""
    return (plgpu.TilingTransform((8, sw // elem_bytes)), plgpu.SwizzleTransform(sw))


def load_row(ref):
    """A [64] column (a value per row) in ROW_LAYOUT: a scale group of a row block, or a token's outputs."""
    return plgpu.load(ref, layout=ROW_LAYOUT, optimized=False)


def glu(g, u, *, situ_beta, situ_linear_beta):
    """W1 x and W3 x (fp32) -> h in bf16: the spec's bf16 rounding of each GEMM (common.round_to, which XLA:GPU's
    excess-precision rewrite keeps), SiTU-GLU in fp32, rounded once (common.situ_glu)."""
    g, u = (common.round_to(a, jnp.bfloat16) for a in (g, u))
    return common.situ_glu(g, u, situ_beta, situ_linear_beta)


def glu_in_kernel(g, u, beta1, beta2):
    """glu inside a kernel (launch fused_glu): the same roundings, by converts (Mosaic GPU keeps a convert pair;
    reduce_precision has no lowering there), SiTU-GLU in fp32 -> h bf16."""
    return common.situ_glu(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16), beta1, beta2)
