"""dptta: differentially private test-time adaptation (DP-TTA), in one file.

Test-time adaptation (Tent, EATA, SAR, DeYO, COME) tunes a model's normalization layers θ on
the unlabeled test stream, and θ then leaks the test images. DP-TTA makes every update
differentially private, so that θ and every prediction for *other* images can be released:

    g_i = ∇θ ℓ(x_i)                                       one sample's own loss
    Δ   = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B      clip, sum, noise, average
    θ  ← SGD-momentum(θ, Δ)                                post-processing: free

A stream shows each test image once, so the whole stream is μ-GDP (Gaussian differential
privacy) in each image, μ = 2/σ: the block "Why it is private" below gives the argument.

    python dptta.py --method dp_deyo --eps 5 --synthetic 4     # a smoke run: CPU, a minute
    python dptta.py --method dp_deyo --eps 5                   # ImageNet-C at $IMAGENET_C, GPU
    adapter = DPTTA(model, "dp_tent", eps=5, clip=1.0, lr=1e-3)  # the library: Part I

Part I (to the end of DPTTA) is the method: copy it. It needs Python >= 3.10, torch >= 2.4
(nn.RMSNorm, torch.nn.attention), numpy and scipy. During its per-sample pass it switches
a process-wide setting (the MultiheadAttention fast path) and hooks the model's adaptive average
pools: one pass at a time.
Part II runs it: the paper's tuned values, ImageNet-C from the command line, --summarize and
--benchmark.
"""

# ============================================================================
# Part I: DP-TTA
#
# Why it is private. The unit is one test image. Two streams are neighbours when one image is
# replaced by another ("change-one"; Opacus counts add/remove neighbours, where the same noise
# gives μ = 1/σ). What is released: θ after every step, so every prediction for another image.
# The guarantee: each step is the Gaussian mechanism with sensitivity 2C, so the stream is
# μ-GDP, μ = 2/σ (Gaussian differential privacy, Dong, Roth & Su 2022, Thm. 2.7): telling
# neighbours apart is no easier than telling N(0, 1) from N(μ, 1). As (ε, δ)-DP it holds with
# δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (their Cor. 2.13) plus the sampler's tail (claim 7),
# against an adversary who cannot tell SHAKE-256's output from random. It rests on these claims:
#  1. Sensitivity 2C. Each sample's gradient is its own (no BatchNorm that normalizes with the
#     batch, no filter that reads the others, DeYO's x′ made from its image alone) and clipped
#     as a whole to C, so replacing one moves the clipped sum by at most 2C.
#     [test_a_private_step_does_not_peek_at_other_samples]
#     [test_deyo_context_row_depends_on_its_image_alone]
#     [test_clip_without_noise_is_the_closed_form_over_all_tensors_jointly]
#  2. Each image in one step: the caller's stream shows it once (the command line refuses a file
#     twice), and accumulate=k makes k batches one step with one noise draw. A host that shows
#     each image k times passes repeats=k: σ then keeps (ε, δ) over the k releases.
#     [test_an_accumulated_window_is_one_step_on_the_concatenated_batches]
#     [test_repeats_keep_the_claim_for_images_a_host_shows_k_times]
#  3. The Gaussian mechanism: N(0, σ²C²I) on the sum (not on the mean), then / B.
#     [test_neighbouring_releases_are_mu_gdp_with_mu_2_over_sigma_by_monte_carlo]
#  4. The noise is secret and never reused: a SHAKE-256 stream keyed from the OS, a block per
#     release; never copied, pickled or rewound; threads that share a stream never draw one
#     block twice, and a fork re-keys every stream in the child, whatever its pid.
#     [test_copies_draw_noise_of_their_own_and_reset_never_rewinds_it]
#     [test_forked_workers_draw_noise_of_their_own_and_a_noise_seed_replays_in_them]
#     [test_a_forked_child_rekeys_at_the_fork_whatever_its_pid_and_with_a_held_lock]
#     [test_threads_drawing_from_one_stream_never_get_one_block_twice]
#  5. The lattice: sum and noise are rounded to one lattice, so that floating point tells no
#     world apart (Mironov 2012); its slack, η = 2^-10, is paid in the noise, (1 + η)σC.
#     [test_a_release_lies_on_one_lattice_whatever_the_data]
#  6. Post-processing is free: momentum or any optimizer whose step reads only θ and the
#     released Δ, EATA's penalty (its F from public images), the predictions, later steps
#     that see an image only through θ.
#     [test_fisher_penalty_is_added_after_the_noise_unclipped]
#     [test_a_hosts_optimizer_steps_on_the_private_delta_and_reset_builds_a_fresh_one]
#  7. The sampler's limits: where its float64 draws could tell neighbours apart and the Gaussian
#     could not (its finite resolution), the chance is counted in δ, and an (ε, δ) it cannot
#     serve is refused. [test_an_eps_delta_beyond_the_samplers_reach_is_refused_in_one_line]
# The suite's audit plays the change-one game against every dp_ method (test_end_to_end_audit_*).
# Not covered: C and lr tuned on the test stream (as the paper did); an image's own prediction
# and any accuracy computed with labels. A photo in k streams (one per ImageNet-C corruption) is
# μ√k-GDP: the command's header prints that ε too.
import contextlib
import copy
import hashlib
import math
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import optimize, special
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel


def require(condition, problem):
    """An argument check: a ValueError whose message is one line."""
    if not condition:
        raise ValueError(problem)


# ----------------------------------------------------------------------------
# 1. What adapts: the norm layers' affine parameters θ
BATCH_NORM = nn.modules.batchnorm._BatchNorm  # timm's BatchNormAct2d is one too
# The adaptable norm layers, with their subclasses (timm's LayerNorm2d, GroupNorm1, BatchNormAct2d).
# timm's own RmsNorm subclasses none of them: add it here to adapt it.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm, BATCH_NORM)


# the fix, first in each refusal of a BatchNorm that would read the batch
BN_FIX = 'bn="source", with running statistics, keeps BatchNorm per sample'


def couples_samples(module):
    """A BatchNorm that normalizes with the batch itself: in train mode, or without running
    statistics. Through it a sample's output, and so its gradient, depends on the others."""
    return isinstance(module, BATCH_NORM) and (module.training or module.running_mean is None)


def refuse_coupled_samples(model):
    """A ValueError naming the model's BatchNorm layers that couple the samples, the fix first."""
    coupled = [n for n, m in model.named_modules() if couples_samples(m)]
    require(not coupled, f"{BN_FIX}: {coupled} use the batch's (train mode, or no statistics)")


def _trunk_cut(model, prefix=""):
    """The name of the module where the trunk's top starts, or None: all but the last 3
    `blocks` of a timm ViT (ViT-B/16: blocks 0-8, as SAR and DeYO adapt), all but a ResNet's
    last layerN. A wrapper (a normalizer and the model, a module holding .model) is looked
    through, to the one child that holds every parameter."""
    if isinstance(getattr(model, "blocks", None), nn.Sequential) and len(model.blocks) > 3:
        return f"{prefix}blocks.{len(model.blocks) - 3}"
    layers = [n for n, _ in model.named_children() if n[:5] == "layer" and n[5:].isdigit()]
    if len(layers) > 1:
        return prefix + max(layers, key=lambda n: int(n[5:]))
    holders = [(name, c) for name, c in model.named_children() if list(c.parameters())]
    if len(holders) == 1:
        name, child = holders[0]
        return _trunk_cut(child, f"{prefix}{name}.")
    return None


def adaptable_params(model, *, norms="all"):
    """{name: parameter} of the norm layers' affine parameters θ, in the model's order. norms:
    "all"; "lower", those below the trunk's top (_trunk_cut: SAR's and DeYO's); or a host's own
    choice, as one argument: a predicate (name, module) -> bool on the norm layers, or the
    parameter names its collect_params returns, which are then θ exactly. BatchNorm's are
    adaptable: whether they may be clipped per sample is DPTTA's question (bn=)."""
    if not (isinstance(norms, str) or callable(norms)):  # a host's list of names
        return {name: model.get_parameter(name) for name in norms}
    require(callable(norms) or norms in ("all", "lower"), f"norms={norms!r}: see adaptable_params")
    cut = None
    if norms == "lower":
        cut = _trunk_cut(model)
        if cut is None:  # said, not silent: SAR's and DeYO's norms are not all of them
            warnings.warn("no trunk (timm's `blocks`, a ResNet's layerN) found: every norm adapts")
    params = {}
    for name, module in model.named_modules():
        if name == cut:
            break
        if not isinstance(module, NORMS) or (callable(norms) and not norms(name, module)):
            continue
        for leaf, p in module.named_parameters(recurse=False):
            params[f"{name}.{leaf}"] = p
    require(params, "the model has no norm-layer affine parameters to adapt")
    return params


# ----------------------------------------------------------------------------
# 2. The per-sample gradients: every g_i from one vmapped forward and one ordinary backward
def logits_of(out):
    """The logits [B, K] in a model's output: the output itself, or its .logits (Hugging Face)."""
    return getattr(out, "logits", out)


def per_sample_grads(model, params, loss_fn, x, context=None, *, chunk_size=None):
    """Every sample's own gradient g_i = ∇θ loss_fn(f_θ(x_i), context_i), and the logits:
    ({name: g [B, *shape]}, logits [B, K]). loss_fn maps (logits [N, K], context rows or None)
    to one loss per sample, [N]; context row i is sample i's own (DeYO's shuffled softmax).

    The trick. The textbook way, vmap(grad(ℓ)) over the batch, runs autograd *inside* vmap,
    and the backward of the GPU's fused attention kernels (flash, efficient, cuDNN) has no
    batching rule: ViT-B/16 at batch 64 would call it 64 × 12 times per step, one image at a
    time. Instead every sample gets its own view θ_i of the parameters ([B, *shape], an
    expand: nothing is copied), the forward runs under vmap over (θ_i, x_i), and ONE ordinary
    backward of Σ_i ℓ_i gives every g_i at once: ℓ_i is the only term that touches θ_i, so
    ∂(Σ_j ℓ_j)/∂θ_i = ∇ℓ_i exactly, and autograd runs each backward kernel once on the whole
    batch."""
    refuse_coupled_samples(model)  # claim 1: no sample's output may read another's
    frozen = {n: t.detach() for n, t in model.named_parameters() if n not in params}
    frozen.update(model.named_buffers())
    if chunk_size is None:  # the whole batch on a GPU; on a CPU 8, which stay in cache
        chunk_size = 8 if x.device.type == "cpu" else len(x)
    rows = x.new_zeros(len(x), 0) if context is None else context  # vmap maps over a tensor

    def loss_one(theta_i, x_i, row_i):  # under vmap: one sample and its own view θ_i
        logits = logits_of(functional_call(model, (theta_i, frozen), (x_i[None],)))
        row = None if context is None else row_i[None]
        return loss_fn(logits, row)[0], logits[0]

    # Ops without a batching rule, swapped for exact equivalents during the pass: SDPA's fused
    # CPU kernel (not even its forward batches) for its math kernel; nn.MultiheadAttention's
    # fast path (torchvision's ViT) for its plain path; and the adaptive average pools of a
    # non-contiguous input (torchvision's ConvNeXt and Swin, Hugging Face's Swin), which
    # restride their mean in place (aten::as_strided_), given the same values contiguous. Any
    # other such op makes vmap run it once per sample (exact, and slow on a GPU), and torch
    # prints a warning that names it.
    kernels = sdpa_kernel(SDPBackend.MATH) if x.device.type == "cpu" else contextlib.nullcontext()
    pools = [m for m in model.modules() if isinstance(m, nn.modules.pooling._AdaptiveAvgPoolNd)]
    hooks = [m.register_forward_pre_hook(lambda m, args: (args[0].contiguous(),)) for m in pools]
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    grads, logits = [], []
    try:
        with kernels:
            for xs, rs in zip(x.split(chunk_size), rows.split(chunk_size)):
                # θ_i: a view of θ per sample, [n, *shape], nothing copied
                theta = {n: p.detach().expand(len(xs), *p.shape) for n, p in params.items()}
                theta = {n: t.requires_grad_() for n, t in theta.items()}
                losses, z = vmap(loss_one)(theta, xs, rs)
                # one backward of Σ_i ℓ_i: ∂/∂θ_i is g_i
                g = torch.autograd.grad(losses.sum(), list(theta.values()), materialize_grads=True)
                grads.append(g)
                logits.append(z.detach())
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        for hook in hooks:
            hook.remove()
    return {n: torch.cat(g) for n, g in zip(params, zip(*grads))}, torch.cat(logits)


# ----------------------------------------------------------------------------
# 3. Clip and noise: the Gaussian mechanism on the sum of clipped gradients
def at_least_fp32(t):
    """bf16 and fp16 to fp32 (fp32 and fp64 kept): losses, Δ and θ's masters need more than
    bf16's 8 bits of mantissa (an update below 2^-8 of θ would round away)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def clip_and_noise(grads, clip, sigma, noise_stream):
    """Δ = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B, over {name: [B, ...]} per-sample
    tensors, in the gradients' dtype (at least fp32). noise_stream: a NoiseStream."""
    # a σ below 0 or NaN would release the sum with no noise, a clip below 0 flip it
    require(0 < clip < math.inf, f"clip must be finite and > 0, got {clip}")
    require(0 <= sigma < math.inf, f"sigma must be finite and >= 0, got {sigma}")
    batch = len(next(iter(grads.values())))  # B, the divisor: every sample, a non-finite one too
    require(batch > 0, "an empty batch: nothing to release")
    g = {n: t.double() for n, t in grads.items()}
    # ‖g_i‖ over every tensor of sample i: a sample is clipped as a whole (claim 1)
    norms = torch.stack([t.flatten(1).pow(2).sum(1) for t in g.values()]).sum(0).sqrt()
    finite = torch.isfinite(norms)
    factor = (clip / norms.clamp(min=1e-12)).clamp(max=1.0)  # min(1, C/‖g_i‖)
    totals = {}
    for name, t in g.items():
        shape = (-1,) + (1,) * (t.dim() - 1)  # a [B] vector, broadcast over t
        # Σ_i g_i·min(1, C/‖g_i‖). A non-finite g_i counts as zero: a choice that reads sample
        # i alone (claim 1); selected away, not scaled by 0 (NaN·0 = NaN)
        totals[name] = torch.where(finite.view(shape), factor.view(shape) * t, 0.0).sum(0)
    if sigma > 0:  # + N(0, σ²C²I): on the sum, whose neighbours are 2C apart (claim 3)
        totals = noisy_on_lattice(totals, clip, sigma, noise_stream)
    return {n: (total / batch).to(at_least_fp32(grads[n]).dtype) for n, total in totals.items()}


# The lattice (claim 5). Float noise takes float values only, and t + z rounds on a grid that
# depends on t: an adversary who computes the sum t of each candidate world can find a
# coordinate of the release that the sampler could not have produced in one of them, and name
# the image with certainty (Mironov 2012). So the sum S (float64) is rounded to S_γ, a multiple
# of γ, and so is the noise: the release S_γ + round_γ(Z) = round_γ(S_γ + Z),
# Z ~ N(0, (1 + η)²σ²C²I), is the Gaussian mechanism on S_γ rounded (post-processing), on the
# same lattice in every world, computed exactly (integers below 2^53 times a power of two).
# Replacing one sample moves S_γ by at most 2C + γ·√d <= 2C + ηC < 2C(1 + η) when γ·√d <= ηC
# (the rest of the slack η·C covers float64's rounding of the clipped sums), and the noise's
# 1 + η (0.1% more than σC; the paper's scripts round σ up by 0.06-1.7%) keeps μ = 2/σ.
ETA = 2.0**-10  # η, the lattice's slack
MAX_COORDINATES = 10**6  # d at most: the sampler's bounds (the accountant's) are proven to here


def noisy_on_lattice(totals, clip, sigma, noise_stream):
    """{name: S_γ + round_γ(Z)} for the clipped sums S: one block of the stream for the whole
    release, fresh noise for every coordinate of every tensor. A zero is +0.0: −0.0 would show
    that S_γ rounded from below."""
    sizes = [t.numel() for t in totals.values()]
    d = sum(sizes)
    require(d <= MAX_COORDINATES, f"{d} coordinates: the noise's accountant holds to 1e6")
    # γ: the largest power of two with γ·√d <= ηC
    gamma = 2.0 ** math.floor(math.log2(ETA * clip / math.sqrt(d)))
    scale = (1 + ETA) * sigma * clip / gamma  # the noise's standard deviation, in γ
    require(scale < 2.0**48, f"sigma {sigma} is beyond the lattice's exact arithmetic")
    noise = noise_stream.normal(d, next(iter(totals.values())).device, torch.float64)
    noisy = {}
    for (name, total), z in zip(totals.items(), noise.split(sizes)):
        # S_γ + round_γ(Z), in multiples of γ: integers, exact in float64
        multiples = torch.round(total / gamma) + torch.round(scale * z.view_as(total))
        noisy[name] = (multiples + 0.0) * gamma  # −0.0 + 0.0 = +0.0
    return noisy


LIVE_STREAMS = weakref.WeakSet()  # every NoiseStream of the process, for _rekey_in_child


class NoiseStream:
    """N(0, 1) draws from a cryptographic stream: block k = SHAKE-256(key ‖ k), one block per
    release, the key 32 bytes from the OS (claim 4). seed: a replay for tests, NOT private."""

    # Why not torch's generator, however seeded: DP's adversary knows every image but one, so
    # it knows each release up to one clipped gradient, of norm <= C over all coordinates,
    # against noise σC in *each*: it reads every draw to a fraction of a standard deviation.
    # torch's CPU mt19937 gives its whole state away to such readings (its output bits are
    # linear in its state bits), and with it every draw, past and future; CUDA's Philox has a
    # 64-bit key. (Opacus' secure_mode is for this.)

    def __init__(self, seed=None):
        self.seed, self.key = seed, os.urandom(32)
        if seed is not None:  # a replay: NOT private, and replayed in a forked child too
            self.key = hashlib.sha256(b"dptta noise seed %d" % seed).digest()
        self.blocks = 0
        self.lock = threading.Lock()
        LIVE_STREAMS.add(self)  # a forked child re-keys it (_rekey_in_child)

    def normal(self, n, device="cpu", dtype=torch.float32):
        """The next block: n draws of N(0, 1), by Box-Muller in float64 on uniforms u1 of 159
        bits and u2 of 106 (see sampler_tail for what their grids leave out)."""
        with self.lock:  # two threads never read one block number
            number = self.blocks
            self.blocks += 1
        block = hashlib.shake_256(self.key + number.to_bytes(8, "little"))
        pairs = (n + 1) // 2
        words = np.frombuffer(block.digest(40 * pairs), np.uint64) >> np.uint64(11)  # 53 bits
        high, mid, low, angle_high, angle_low = words.astype(np.float64).reshape(5, pairs)
        # u1 = (k + ½)/2^159 for a 159-bit k, and 1 − u1 = (k′ + ½)/2^159 for k′ = 2^159 − 1 − k,
        # the complemented words: float64 holds each to its last bit where it is small, u1 in the
        # far tail and 1 − u1 at the centre, where −ln u1 = −log1p(−(1 − u1))
        u1 = (high + (mid + (low + 0.5) / 2.0**53) / 2.0**53) / 2.0**53
        ones = 2.0**53 - 1
        v1 = ((ones - high) + ((ones - mid) + (ones - low + 0.5) / 2.0**53) / 2.0**53) / 2.0**53
        minus_log_u1 = np.where(u1 < 0.5, -np.log(u1), -np.log1p(-v1))
        u2 = (angle_high + (angle_low + 0.5) / 2.0**53) / 2.0**53
        # z = √(−2 ln u1)·(cos 2πu2, sin 2πu2): two independent N(0, 1) per pair (u1, u2)
        radius, angle = np.sqrt(2 * minus_log_u1), 2 * math.pi * u2
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
        return torch.from_numpy(z).to(device=device, dtype=dtype)

    def __reduce_ex__(self, protocol):
        raise TypeError("a NoiseStream is never copied or pickled: the copy would draw its noise")


def _rekey_in_child():
    """At a fork, in the child: every secret stream takes a key of its own from the OS (with
    its parent's key it would draw its parent's next blocks again: the same noise in two
    releases), and a fresh lock (another thread of the parent may have held it)."""
    for stream in LIVE_STREAMS:
        stream.lock = threading.Lock()
        if stream.seed is None:
            stream.key = os.urandom(32)


if hasattr(os, "register_at_fork"):  # (POSIX: no fork elsewhere)
    os.register_at_fork(after_in_child=_rekey_in_child)


# ----------------------------------------------------------------------------
# 4. The accountant: one pass over the stream is μ-GDP with μ = 2/σ
# Its floors keep σ where the sampler's limits are small against ε and δ (sampler_tail): with
# δ >= 1e-12 and ε >= 0.01, σ < 1.2e3, and the libm rounding that sampler_tail does not count
# stays below 1e-5 relative, an ε of 2e-5 (0.2% of the smallest).
MIN_EPS, MIN_DELTA = 0.01, 1e-12


def sampler_tail(sigma):
    """The chance, per release, that NoiseStream tells two neighbouring worlds apart where the
    accountant's Gaussian would not: a bound, counted in δ.

    The Gaussian reaches every lattice point, with a smooth chance; the sampler's float64 draws
    do not. Its u1 (159 random bits) is held to 53 significant bits, and to 2^-159 in the far
    tail, so in units of the noise's (1 + η)σC its radii √(−2 ln u1) step by at most
    s·2^-52/r lattice steps, s the noise's standard deviation in lattice steps (below
    2(1 + η)σ√d/η), and far out by s·2^-159·e^(r²/2)/r: below 2^-30 up to r = √(2 ln(2^129/s)).
    Within r (less the rounding's 2η/σ), then, every lattice point is drawn, with the rounded
    Gaussian's chance to a relative error of about those steps and libm's rounding of log, cos
    and sin: up to 1e-5 at the floors, 2e-8 at the paper's settings (an ε of twice that, not
    counted).

    A neighbour's release is the same sum moved by at most μ = 2/σ in those units, s_k on pair
    k (Σ s_k² <= μ²): it meets a point beyond r only where this world's pair k lies beyond
    r − s_k, a chance e^(−(r − s_k)²/2), convex in s_k below r − 1 (above, the bound exceeds
    1), so at most e^(−r²/2) + s_k/μ·e^(−(r − μ)²/2). Over the m <= d/2 pairs, Σ s_k <= √m·μ:
    at most (d/2)·e^(−r²/2) + √(d/2)·e^(−(r − μ)²/2). (A shift spread over many pairs is the
    worse case where μ is small.)"""
    d, mu = MAX_COORDINATES, 2 / sigma
    steps = 2 * (1 + ETA) * sigma * math.sqrt(d) / ETA  # s, the noise in lattice steps, at most
    r = math.sqrt(2 * math.log(2.0**129 / steps)) - 2 * ETA / sigma
    return d / 2 * math.exp(-r * r / 2) + math.sqrt(d / 2) * math.exp(-(max(r - mu, 0) ** 2) / 2)


def _log_gdp_delta(eps, sigma):
    """log δ(ε) for μ = 2/σ, computed in logs so that no Φ underflows and e^ε never overflows.

    δ = Φ(a) − e^ε Φ(a − μ) with a = −σε/2 + 1/σ, so log δ = log Φ(a) + log(1 − e^−D) where
    D = log Φ(a) − ε − log Φ(a − μ) > 0. Where δ is far below Φ(a), D is small and that
    difference of logs has lost its digits; then D is integrated instead,
    D = ∫_{a−μ}^{a} (φ(u)/Φ(u) + u) du (the derivative of log Φ(u) + u²/2, whose difference
    between the ends is D), by a 16-point Gauss-Legendre rule, with φ/Φ = √(2/π)/erfcx(−u/√2)
    to a few ulps at any u (a ratio of exponentials would lose them all far out, to NaN)."""
    mu = 2 / sigma
    a = -eps / mu + mu / 2
    log_phi_a = float(special.log_ndtr(a))  # (Python floats: no numpy warning on inf − inf)
    D = log_phi_a - eps - float(special.log_ndtr(a - mu))
    if D < 0.1:
        nodes, weights = np.polynomial.legendre.leggauss(16)
        u = a - mu / 2 + nodes * mu / 2  # [a − μ, a] mapped to Legendre's [−1, 1]: du = μ/2 dt
        mills = math.sqrt(2 / math.pi) / special.erfcx(-u / math.sqrt(2))  # φ(u)/Φ(u)
        D = mu / 2 * float(np.sum(weights * (mills + u)))
    if log_phi_a == -math.inf or not D > 0:  # δ is 0 to float64 (or a beyond its range)
        return -math.inf
    return log_phi_a + math.log(-math.expm1(-D))


def gdp_delta(*, eps, sigma):
    """δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ): a sum of sensitivity 2C with Gaussian
    noise of standard deviation σC is (2/σ)-GDP (Dong, Roth & Su 2022, Thm. 2.7), which is
    (ε, δ(ε))-DP for every ε (their Cor. 2.13)."""
    require(eps > 0 and sigma >= 0, f"need eps > 0 and sigma >= 0, got {eps}, {sigma}")
    if sigma == 0:
        return 1.0
    if math.isinf(eps) or math.isinf(sigma):
        return 0.0
    return math.exp(_log_gdp_delta(eps, sigma))


def _smallest(f, lo, hi):
    """The smallest x with f(x) <= 0 for a decreasing f, never a hair short of it: the root is
    then nudged up until it meets the bound (rounded up, never down)."""
    while f(lo) < 0:
        lo /= 2
    while f(hi) > 0:
        hi *= 2
    x = optimize.brentq(f, lo, hi, xtol=1e-300, rtol=1e-12)
    while f(x) > 0:
        x *= 1 + 1e-12
    return float(x)


def calibrate_sigma(*, eps, delta, repeats=1):
    """The smallest σ with δ(ε) + the sampler's tail <= delta, for `repeats` releases of each
    unit: k releases of (2/σ)-GDP compose to (2√k/σ)-GDP (ibid., Cor. 3.3), so σ = √k·σ_1, and
    each release may meet the sampler's limits (sampler_tail). eps = inf: σ = 0.

    An (ε, δ) the sampler cannot serve is refused: its tail must stay below δ/1000, so that the
    Gaussian keeps its δ (at δ = 1e-6: ε up to 34.7; at ε = 20 the tail is 1e-15 a release)."""
    require(eps >= MIN_EPS, f"eps must be >= {MIN_EPS:g} (inf: no noise), got {eps}")
    require(MIN_DELTA <= delta < 1, f"delta must be in [{MIN_DELTA:g}, 1), got {delta}")
    require(isinstance(repeats, int) and repeats >= 1, "repeats must be an int >= 1")
    if math.isinf(eps):
        return 0.0
    k = math.sqrt(repeats)

    def excess(sigma_1):  # δ(ε) + the tail − delta, computed as gdp_delta computes δ
        return math.exp(_log_gdp_delta(eps, sigma_1)) + repeats * sampler_tail(k * sigma_1) - delta

    sigma = k * _smallest(excess, 0.1, 1.0)
    beyond = f"eps {eps:g} at delta {delta:g} is beyond the noise sampler's reach"
    require(repeats * sampler_tail(sigma) <= delta / 1000, beyond)
    return sigma


def gdp_epsilon(*, sigma, delta):
    """The smallest ε with δ(ε) <= delta at noise σ, for the accountant's Gaussian (pass delta
    less the sampler's tail to count it); inf for σ = 0 (no noise)."""
    require(sigma >= 0 and 0 < delta < 1, f"need sigma >= 0, 0 < delta < 1: {sigma}, {delta}")
    if sigma == 0:
        return math.inf
    if math.isinf(sigma) or _log_gdp_delta(0.0, sigma) <= math.log(delta):  # ε = 0 meets it
        return 0.0
    return _smallest(lambda e: math.exp(_log_gdp_delta(e, sigma)) - delta, 1e-6, 1.0)


# ----------------------------------------------------------------------------
# 5. The methods, as data: a per-sample loss and a few small functions each
# Tent (Wang et al. 2021), EATA (Niu et al. 2022), SAR (Niu et al. 2023), DeYO (Lee et al.
# 2024), COME (Zhang et al. 2025). H: softmax entropy; H_come: COME's; E0 = e_margin·ln K;
# m: EATA's moving average of softmaxes; PLPD: DeYO's pseudo-label probability drop on x′, the
# image with its patches shuffled; "lower": the norms below the trunk's top
# method     per-sample loss ℓ_i          original's filter            norms  extra
# tent       H                            -                            all    -
# come       H_come                       -                            all    -
# eata       exp(E0 − H)·H                H < E0, |cos(m,p)| < d_margin all   λ·ΣF(θ − θ0)²
# sar        H                            H < E0; reset on collapse    lower  SAM, ρ·g/‖g‖
# deyo       (exp(E0 − H) + e^PLPD)·H     H < deyo_margin·ln K, PLPD   lower  x′: shuffled
# deyo_come  as deyo, H_come for H        as deyo, with H_come         lower  as deyo
# dp_<one of them>: the same ℓ_i clipped and noised, no filter; SAR's ascent along the last Δ
def no_penalty(theta, theta0, hp):
    return {}  # most methods have no data-free term


@dataclass(frozen=True)
class Method:
    """A test-time adaptation method as data: DPTTA runs any such record, one of METHODS or
    one's own. Functions take hp, the method's constants as the adapter has them."""

    # in records and tables
    name: str
    # ℓ_i(logits [N, K], context, hp) -> [N]: each sample's own loss, clipped per sample
    loss: Callable = None
    # the original's filter: (logits, context, state, hp) -> (keep [N] bool, its new state)
    filter: Callable = None
    # (model, x, generator, hp) -> context, ℓ_i's other input (DeYO's softmax of the shuffled
    # x′), row i from image i alone (claim 1)
    context: Callable = None
    # "all", or "lower": the norms below the trunk's top (SAR, DeYO); or a host's choice, a
    # predicate (name, module) or the names of its tensors (adaptable_params)
    norms: str | Callable | list = "all"
    # (θ, θ0, hp) -> {name: gradient} of a data-free term, added after the noise
    penalty: Callable = no_penalty
    # "plain", "sam" (SAR's sharpness-aware step; its DP variant is DP-SAT) or "none"
    step: str = "plain"
    # the defaults of hp: those that loss, context, penalty and step read ...
    constants: dict = field(default_factory=dict)
    # ... and those only the original's data-dependent choices read (its filter, SAR's reset)
    filter_constants: dict = field(default_factory=dict)
    # a DP variant, made by private()
    dp: bool = False


def private(method):
    """The DP variant, by the paper's recipe: ℓ_i clipped and noised, the penalty after the
    noise, SAM's ascent along the previous private gradient (DP-SAT, Park et al. 2023). The
    filter goes with the constants only it read: whether sample i counts must not depend on
    sample j, and how many are kept (the divisor) is data. SAR's reset goes too: decided on a
    batch's entropy, it would be a release of its own."""
    return replace(method, name="dp_" + method.name, filter=None, filter_constants={}, dp=True)


# The losses, one value per sample: logits [N, K] -> [N]
def entropy(logits):
    """H(p) = −Σ_k p_k log p_k with p = softmax(z), in fp32 or better."""
    logp = at_least_fp32(logits).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def come_entropy(logits, num_classes=None):
    """COME's loss: the entropy of the Dirichlet opinion (b, u) instead of the softmax.

    z ← z/‖z‖·stopgrad(‖z‖) keeps z's value and takes away the gradient along z (the loss
    cannot be lowered by inflating the logits); then with e = exp(z) and S = Σe + K, b = e/S,
    u = K/S, i.e. [b, u] = softmax([z, ln K]) (computed so, with no overflow), and the loss is
    −Σ_{j=1}^{K+1} q_j log q_j for q = [b, u] + 1e-7. K: num_classes, or the logits'."""
    z = at_least_fp32(logits)
    norm = z.norm(dim=-1, keepdim=True)
    z = z / norm.clamp(min=1e-12) * norm.detach()  # all-zero logits: 0, not NaN
    k = z.shape[-1] if num_classes is None else num_classes
    log_k = torch.full_like(z[..., :1], math.log(k))
    q = torch.cat([z, log_k], -1).softmax(-1) + 1e-7
    return -(q * q.log()).sum(-1)


def plpd(logits, shuffled_probs):
    """DeYO's PLPD (pseudo-label probability difference) = p(ŷ|x) − p(ŷ|x′), ŷ = argmax p(·|x),
    detached: how much a prediction rests on the image's shape, which shuffling its patches
    (x′) destroys."""
    p = at_least_fp32(logits).softmax(-1)
    y = p.argmax(-1, keepdim=True)
    return (p.gather(-1, y) - shuffled_probs.gather(-1, y)).squeeze(-1).detach()


def patch_shuffle(x, grid, generator):
    """x′: each image cut into grid×grid patches, put back in an order of its own. Pixels
    beyond the last whole patch (H or W not divisible by grid) stay where they are."""
    h, w = x.shape[-2] // grid, x.shape[-1] // grid  # one patch
    H, W = h * grid, w * grid  # the part cut into patches
    patches = F.unfold(x[..., :H, :W], (h, w), stride=(h, w))  # [B, channels·h·w, grid²]
    perm = torch.rand(len(x), grid * grid, generator=generator, device=x.device).argsort(1)
    patches = patches.gather(2, perm[:, None].expand_as(patches))  # patch j <- patch perm_j
    out = x.clone()
    out[..., :H, :W] = F.fold(patches, (H, W), (h, w), stride=(h, w))
    return out


def num_classes(logits, hp):
    """K: the constant num_classes if set, else the logits' (ln K scales every margin)."""
    return logits.shape[-1] if hp.get("num_classes") is None else hp["num_classes"]


def tent_loss(logits, context, hp):
    return entropy(logits)  # ℓ_i = H(x_i)


def come_loss(logits, context, hp):
    return come_entropy(logits, num_classes(logits, hp))  # ℓ_i = H_come(x_i)


def weighted_loss(logits, context, hp, entropy_loss=tent_loss):
    """EATA's and DeYO's ℓ_i = w_i·H_i, the weight detached: w = exp(E0 − H) with
    E0 = e_margin·ln K, plus DeYO's e^PLPD where the context is the shuffled view's softmax
    (EATA has none). entropy_loss: the entropy H (DeYO-COME: COME's)."""
    H = entropy_loss(logits, context, hp)
    # w = exp(E0 − H), E0 = e_margin·ln K
    w = torch.exp(hp["e_margin"] * math.log(num_classes(logits, hp)) - H.detach())
    if context is not None:
        w = w + torch.exp(plpd(logits, context))  # + e^PLPD (DeYO)
    return w * H


# The originals' filters: pure functions of the batch's logits (and state) -> (keep, new state)
def reliable(H, logits, hp, margin):
    """The originals' entropy filter: H < margin·ln K."""
    return H < hp[margin] * math.log(num_classes(logits, hp))


def sar_filter(logits, context, state, hp):
    return reliable(entropy(logits), logits, hp, "e_margin"), state


def eata_filter(logits, context, state, hp):
    """Reliable (H < E0) and not redundant with the recent samples: |cos(m, p)| < d, where m
    is the moving average of kept softmaxes, m ← 0.9·m + 0.1·mean(p of kept)."""
    keep = reliable(entropy(logits), logits, hp, "e_margin")
    p = at_least_fp32(logits).softmax(-1)
    m = state.get("m")
    if m is not None:  # (|·| as EATA's code has it; between softmaxes cos >= 0 anyway)
        keep = keep & (torch.cosine_similarity(m[None], p, 1).abs() < hp["d_margin"])
    if keep.any():  # m ← 0.9·m + 0.1·mean(p of kept); the first: m = mean(p of kept)
        mean = p[keep].mean(0)
        state = {**state, "m": mean if m is None else 0.9 * m + 0.1 * mean}
    return keep, state


def deyo_filter(logits, shuffled_probs, state, hp, entropy_loss=tent_loss):
    """Reliable (H < deyo_margin·ln K) and shape-dependent (PLPD > plpd_threshold)."""
    keep = reliable(entropy_loss(logits, shuffled_probs, hp), logits, hp, "deyo_margin")
    return keep & (plpd(logits, shuffled_probs) > hp["plpd_threshold"]), state


def shuffled_softmax(model, x, generator, hp, entropy_loss=tent_loss):
    """DeYO's context: the softmax of x′, the patch-shuffled images, with no gradient.

    DeYO's code shuffles and forwards only the samples its entropy filter keeps. Where each
    sample goes through the model alone, that equals forwarding every x′. A BatchNorm that
    normalizes with the batch (an original's train mode) sees x′'s batch, though: as in DeYO's
    code, it is then the kept samples' alone, and the others' rows are zero (the filter drops
    them). The DP variants forward every x′: they have no filter, and refuse such a BatchNorm."""
    x_shuffled = patch_shuffle(x, hp["patch_grid"], generator)
    if not any(couples_samples(m) for m in model.modules()):
        return at_least_fp32(logits_of(model(x_shuffled))).softmax(-1)
    logits = at_least_fp32(logits_of(model(x)))  # the step's own forward: θ has not moved
    kept = reliable(entropy_loss(logits, None, hp), logits, hp, "deyo_margin")
    probs = torch.zeros_like(logits)
    if kept.any():
        probs[kept] = at_least_fp32(logits_of(model(x_shuffled[kept]))).softmax(-1)
    return probs


# EATA's anti-forgetting term: data-free once F is computed, on public clean images
def fisher_penalty(theta, theta0, hp):
    """The gradient 2λF(θ − θ0) of λ·Σ F(θ − θ0)²: it reads θ, θ0 and F alone, so it is added
    after the noise, unclipped (claim 6); none where there is no F."""
    if hp["fisher"] is None:
        return {}
    drift = {n: p.detach() - theta0[n] for n, p in theta.items()}
    # ∇ λ·Σ F(θ − θ0)² = 2λF(θ − θ0)
    return {n: 2 * hp["fisher_lambda"] * hp["fisher"][n] * d for n, d in drift.items()}


def fisher_information(model, params, images, n=2000, bn="train"):
    """EATA's F on n public clean images (batches x, or a loader's (x, y)), as EATA's code
    computes it: the mean over batches of the squared gradient of the batch's mean
    CE(f(x), argmax f(x)). Pass it to the DPTTA of eata or dp_eata as the constant fisher.

    BatchNorm normalizes as the adapter's will: with each batch's statistics (bn="train", as
    EATA's code) or its source ones (bn="source"), in a copy of the model: the model is left
    as it was found, its modes and its running statistics (which BatchNorm's train mode
    updates)."""
    model = copy.deepcopy(model).eval()  # no dropout
    for m in model.modules():
        if isinstance(m, BATCH_NORM) and bn == "train":
            m.train()
    p = {k: t.detach().requires_grad_() for k, t in params.items()}
    fisher = {k: torch.zeros_like(t) for k, t in p.items()}
    batches, seen = 0, 0
    for x in images:
        if isinstance(x, (list, tuple)):  # a loader's (x, y)
            x = x[0]
        x = x[: n - seen].to(next(iter(p.values())).device)
        logits = logits_of(functional_call(model, p, (x,)))
        loss = F.cross_entropy(logits, logits.argmax(1))
        for k, g in zip(p, torch.autograd.grad(loss, list(p.values()))):
            fisher[k] += g**2  # a batch's gradient squared, not each sample's
        batches, seen = batches + 1, seen + len(x)
        if seen >= n:
            break
    return {k: f / batches for k, f in fisher.items()}


# The records
SOURCE = Method("source", step="none")
TENT = Method("tent", tent_loss)
COME = Method("come", come_loss, constants=dict(num_classes=None))
EATA = Method(
    "eata",
    loss=weighted_loss,
    filter=eata_filter,
    penalty=fisher_penalty,
    constants=dict(e_margin=0.4, num_classes=None, fisher=None, fisher_lambda=2000.0),
    filter_constants=dict(d_margin=0.05),
)
SAR = Method(
    "sar",
    loss=tent_loss,
    filter=sar_filter,
    norms="lower",
    step="sam",
    constants=dict(rho=0.05),
    filter_constants=dict(e_margin=0.4, num_classes=None, reset_ema=0.2),
)
DEYO = Method(
    "deyo",
    loss=weighted_loss,
    filter=deyo_filter,
    context=shuffled_softmax,
    norms="lower",
    constants=dict(e_margin=0.4, num_classes=None, patch_grid=4),
    filter_constants=dict(deyo_margin=0.5, plpd_threshold=0.2),
)
DEYO_COME = replace(
    DEYO,
    name="deyo_come",
    loss=partial(weighted_loss, entropy_loss=come_loss),
    filter=partial(deyo_filter, entropy_loss=come_loss),
    context=partial(shuffled_softmax, entropy_loss=come_loss),
)
ORIGINALS = (TENT, COME, EATA, SAR, DEYO, DEYO_COME)
METHODS = {m.name: m for m in (SOURCE, *ORIGINALS, *map(private, ORIGINALS))}


# ----------------------------------------------------------------------------
# 6. The adapter
class DPTTA(nn.Module):
    """A test-time adapter: forward(x) returns x's logits, predicted with the current θ, then
    adapts θ on x (with accumulate=k: once k batches have come). .sigma is σ(ε, δ); .params
    is θ, in fp32 (masters of a half-precision model's own); reset() goes back to the source."""

    def __init__(
        self,
        # the model, on its device: the adapter sets it for good (eval mode, no gradients but
        # θ's; with bn="train", BatchNorm on the batch's statistics). One adapter per model:
        # two would share θ
        model,
        # a Method, or its name in METHODS: "source", an original ("tent", "come", "eata",
        # "sar", "deyo", "deyo_come") or its DP variant "dp_<name>"
        method,
        *,
        # a DP variant's (ε, δ); eps=inf: the DP recipe with no noise (and no filter: the
        # paper's "clip-only" is the original given a clip, its filters kept)
        eps=None,
        delta=1e-6,
        # the per-sample clip C: a DP variant needs it; given to an original, clip-only
        clip=None,
        # the short form of the optimizer every original uses: SGD(lr, momentum 0.9) ...
        lr=None,
        # ... or a function from θ's parameters to a torch.optim.Optimizer, as
        # functools.partial(torch.optim.Adam, lr=1e-3). It sees only the released Δ, so any
        # optimizer is post-processing (claim 6); reset() builds a fresh one
        optimizer=None,
        # BatchNorm normalizes with the test batch ("train": Tent's; no clip then) or stays
        # at its source statistics ("source": a per-sample map)
        bn="train",
        # a step per k batches, on the k batches together (a stream of single images)
        accumulate=1,
        # how often the caller shows each image (claim 2): σ is calibrated so that k
        # releases of it keep (ε, δ). A host that revisits images (a benchmark's gradual
        # setting, several rounds over one set) passes their count
        repeats=1,
        # the norms that adapt, if not the method's: "all", "lower", or a host's own choice,
        # a predicate (name, module) or the names its collect_params returns (adaptable_params)
        norms=None,
        # DeYO's patch shuffles, never the noise: that is secret, keyed from the OS, unless
        # noise_seed replays it (for tests: NOT private)
        seed=0,
        noise_seed=None,
        # the method's constants that differ from its defaults: EATA's fisher, made by
        # fisher_information(model, adaptable_params(model), clean_batches); e_margin, ...
        **hp,
    ):
        super().__init__()
        if isinstance(method, str):
            method = METHODS[method]
        if norms is not None:
            method = replace(method, norms=norms)
        self.method, name, by_gradient = method, method.name, method.step != "none"
        # a DP variant without eps or clip would release its steps with no noise, or unclipped
        require((eps is not None) == method.dp, f"eps is for dp_ methods, which need it ({name})")
        require(clip is not None or not method.dp, f"{name} needs clip, C")
        require(not (method.dp and method.filter), f"{name}: a DP variant has no filter")
        fits = (lr is None) != (optimizer is None) or not by_gradient
        require(fits, f"{name} takes lr or optimizer (SGD's lr, or one's own), one of them")
        require(bn in ("train", "source"), "bn is 'train' or 'source'")
        require(isinstance(accumulate, int) and accumulate >= 1, "accumulate must be an int >= 1")
        self.hp = {**method.constants, **method.filter_constants}
        unknown = " ".join(set(hp) - set(self.hp))  # a typo: the default silently in force
        require(not unknown, f"{name} has no constant {unknown}")
        self.hp.update(hp)
        for margin in ("e_margin", "deyo_margin"):  # (SAR's and EATA's --e_margin is E0 itself)
            require(self.hp.get(margin, 0) <= 1, f"{margin} is in ln K: 0.4 means 0.4·ln K")
        # σ(ε, δ) for `repeats` releases of each image; the originals: no noise
        self.sigma = 0.0 if eps is None else calibrate_sigma(eps=eps, delta=delta, repeats=repeats)
        self.eps, self.delta, self.clip, self.lr = eps, delta, clip, lr
        self.accumulate, self.make_optimizer = accumulate, optimizer
        if optimizer is None:  # every original's SGD
            self.make_optimizer = partial(torch.optim.SGD, lr=lr, momentum=0.9)
        self.model = model.eval().requires_grad_(False)  # eval: no dropout, nothing random
        batch_norms = [m for m in model.modules() if isinstance(m, BATCH_NORM)]
        if clip is not None or bn == "source":  # per sample: BatchNorm at source statistics
            require(bn == "source" or not batch_norms, f"{BN_FIX}: a clip needs it")
            refuse_coupled_samples(model)  # (statistics that a host's Tent deleted)
        elif by_gradient:  # Tent's BatchNorm: the test batch's statistics
            for m in batch_norms:
                m.train()
                m.track_running_stats = False
        own = adaptable_params(model, norms=method.norms) if by_gradient else {}  # θ's tensors
        # θ: fp32 masters of bf16/fp16 parameters (bf16 rounds away an update below 2^-8)
        self.params = {n: at_least_fp32(p).requires_grad_() for n, p in own.items()}
        self.theta0 = {n: p.detach().clone() for n, p in self.params.items()}
        # the adapter's own streams, never rewound by reset(): the same noise twice cancels
        self.noise = NoiseStream(noise_seed)
        self.shuffle_gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
        self.reset()

    def reset(self):
        """Back to the source: θ, a fresh optimizer (no momentum), the method's state (EATA's
        m, SAR's ema, DP-SAT's last Δ); a pending window is dropped. The noise runs on."""
        self._set_theta(self.theta0)
        self.opt = self.make_optimizer(self.params.values()) if self.params else None  # (source)
        self.state, self.window = {}, []

    @torch.no_grad()
    def _set_theta(self, values):
        """θ ← values, written into the model (rounded for a bf16 model)."""
        for n, p in self.params.items():
            p.copy_(values[n])
            self.model.get_parameter(n).copy_(p)  # p itself in an fp32 model: a no-op

    def train(self, mode=True):
        """The adapter keeps its model's modes (eval; BatchNorm as `bn` says): an outer
        train() or eval() would switch dropout on, or Tent's BatchNorm off."""
        return self

    def loss(self, logits, context):
        """ℓ_i, the per-sample loss whose gradient is clipped: the method's loss with its hp
        bound, the loss_fn(logits, context) that per_sample_grads takes."""
        return self.method.loss(logits, context, self.hp)

    @torch.no_grad()
    def context(self, x):
        """ℓ_i's other input (DeYO's softmax of the shuffled x′), or None."""
        if self.method.context is None:
            return None
        return self.method.context(self.model, x, self.shuffle_gen, self.hp)

    # -- the stream: predict, then adapt ------------------------------------------------------
    def forward(self, x):
        if self.method.step == "none" or len(x) == 0:  # source; an empty batch: no step
            with torch.no_grad():
                return logits_of(self.model(x))
        if self.clip is not None:  # before any forward: a model.train() since it was built?
            refuse_coupled_samples(self.model)
        if self.accumulate == 1:
            return self._update(x)
        # accumulate=k: predict each batch with θ, step once k have come. θ is fixed within a
        # window, so this is one step on the k batches: one noise draw, σC on the sum of k·B
        # clipped gradients (k steps would add k draws to θ, √k times the noise)
        with torch.no_grad():
            logits = logits_of(self.model(x))
        self.window.append(x.detach().clone())  # a caller may write its next batch into x
        if len(self.window) == self.accumulate:
            self.flush()
        return logits

    def flush(self):
        """A step on the pending window's batches; call it when a stream ends."""
        if self.window:
            x, self.window = torch.cat(self.window), []
            self._update(x)

    def _update(self, x):
        """One step on x; x's logits, predicted before it."""
        with torch.inference_mode(False), torch.enable_grad():  # callers under no_grad too
            if x.is_inference():
                x = x.clone()
            context = self.context(x)
            if self.method.step == "sam":  # SAR's SAM; its DP variant's DP-SAT
                step = self._dp_sat_step if self.method.dp else self._sam_step
                return step(x, context).detach()
            # private with a clip (dp_, and the originals' clip-only), else plain
            gradient = self._plain_gradient if self.clip is None else self._private_gradient
            logits, g, _ = gradient(x, context, self.params)
            if g is not None:  # None: the filter kept no sample, and there is no step
                self._step(g)
            return logits.detach()

    # -- the gradient at θ (or SAM's ascent point): private, or plain -------------------------
    def _private_gradient(self, x, context, theta, keep=None):
        """(logits, Δ, keep): every g_i in one pass, then Δ = clip_and_noise of those the
        original's filter keeps (all, for a DP variant), over their number; Δ None if none."""
        g, logits = per_sample_grads(self.model, self._in_model(theta), self.loss, x, context)
        keep = self._kept(logits, context, keep)
        if not keep.any():
            return logits, None, keep
        g = {n: t[keep] for n, t in g.items()}  # clip-only originals: the kept, their number
        return logits, clip_and_noise(g, self.clip, self.sigma, self.noise), keep

    def _plain_gradient(self, x, context, theta, keep=None):
        """(logits, g, keep): g = ∇ mean ℓ_i over the samples kept, one batched backward, as
        the originals compute it; g None if none is kept."""
        theta = {n: t.requires_grad_() for n, t in self._in_model(theta).items()}
        logits = logits_of(functional_call(self.model, theta, (x,)))
        keep = self._kept(logits, context, keep)
        if not keep.any():
            return logits, None, keep
        g = torch.autograd.grad(self.loss(logits, context)[keep].mean(), list(theta.values()))
        return logits, {n: at_least_fp32(t) for n, t in zip(theta, g)}, keep

    def _in_model(self, theta):
        """θ (or a point near it), detached, in the model's dtype: what its forward takes."""
        return {n: t.detach().to(self.model.get_parameter(n).dtype) for n, t in theta.items()}

    def _kept(self, logits, context, keep):
        """The mask of the samples the original's filter keeps (no filter: every one). Given
        SAM's first mask, the two intersected; else this is the step's first filter, and its
        new state (EATA's m) is kept."""
        if self.method.filter is None:
            return torch.ones(len(logits), dtype=torch.bool, device=logits.device)
        kept, state = self.method.filter(logits.detach(), context, self.state, self.hp)
        if keep is not None:
            return keep & kept
        self.state = state
        return kept

    # -- the steps ---------------------------------------------------------------------------
    def _step(self, g):
        """θ ← the optimizer's step on Δ + the method's data-free term (post-processing)."""
        # a data-free term's gradient (EATA's; none by default), added after the noise
        penalty = self.method.penalty(self.params, self.theta0, self.hp)
        for n, p in self.params.items():
            p.grad = g[n].to(p.dtype) + penalty.get(n, 0.0)
        self.opt.step()
        self.opt.zero_grad()  # (a host's own optimizer on θ then finds no Δ to step on again)
        self._set_theta(self.params)

    def _sam_step(self, x, context):
        """SAR's SAM: ascend along the plain mean gradient of the kept samples (clip-only too,
        as the paper's code does), take the gradient at θ + ρ·g/‖g‖ on those still kept
        there, step from θ; then its recovery."""
        logits, direction, keep = self._plain_gradient(x, context, self.params)
        if direction is None:
            return logits
        gradient = self._plain_gradient if self.clip is None else self._private_gradient
        at_ascent, g, keep = gradient(x, context, self._ascent(direction), keep)
        if g is None:
            return logits
        self._step(g)
        if "reset_ema" in self.hp:  # SAR's recovery (a method of one's own may have none)
            loss = entropy(at_ascent.detach())[keep].mean().item()  # H at the ascent point
            ema = 0.9 * self.state.get("ema", loss) + 0.1 * loss  # the first: ema = loss
            self.state = {**self.state, "ema": ema}
            if ema < self.hp["reset_ema"]:  # a collapse: θ, the optimizer and ema reset
                self.reset()
        return logits

    def _dp_sat_step(self, x, context):
        """DP-SAT, SAR's DP variant: the ascent direction is the previous *private* Δ (free:
        it is released; none at the first step), one private gradient per step, and the
        prediction is made at θ, not at the ascent point. No recovery."""
        direction = self.state.get("g_prev")
        ascent = self.params if direction is None else self._ascent(direction)
        logits, g, _ = self._private_gradient(x, context, ascent)
        if direction is not None:  # those logits are at θ + ρ·Δ/‖Δ‖: predict at θ
            with torch.no_grad():
                logits = logits_of(self.model(x))
        self._step(g)
        self.state = {**self.state, "g_prev": g}
        return logits

    def _ascent(self, g):
        """SAM's ascent point θ + ρ·g/‖g‖."""
        norm = torch.stack([t.pow(2).sum() for t in g.values()]).sum().sqrt().clamp(min=1e-12)
        return {n: p + self.hp["rho"] * g[n] / norm for n, p in self.params.items()}

    # -- copies: never the noise, never a pending window (claims 2 and 4) --------------------
    def __getstate__(self):
        """copy.copy, copy.deepcopy and pickle: never the noise stream (its key regenerates
        every draw, past ones too), never a pending window (a copy would step on its images
        too): it is refused, and a copy's window is its own."""
        require(not self.window, "pending accumulate batches: flush() before a copy or pickle")
        return dict(super().__getstate__(), noise=None, window=[])

    def __setstate__(self, state):
        """A copy draws its noise from a stream of its own, keyed from the OS."""
        super().__setstate__(state)
        self.noise = NoiseStream()


# ============================================================================
# Part II: the paper's tuned values, and ImageNet-C from the command line
import argparse
import json
import platform
import signal
import sys
import tempfile
import time

import timm
from PIL import Image
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

# ----------------------------------------------------------------------------
# The paper's hyperparameters: ViT-B/16, batch 64, δ = 1e-6, tuned on the test stream
TUNED_EPS = (20, 15, 10, 5, 1)
# dp_<method>'s (C, lr) at each tuned ε: setting -> method -> {ε: (C, lr)}
PAPER_DP = dict(
    continual=dict(
        tent={20: (0.1, 0.1), 15: (0.1, 0.05), 10: (0.1, 0.05), 5: (1, 1e-3), 1: (0.1, 5e-3)},
        eata={20: (1, 0.01), 15: (1, 5e-3), 10: (1, 5e-3), 5: (10, 1e-4), 1: (0.1, 5e-3)},
        sar={20: (10, 5e-4), 15: (10, 5e-4), 10: (15, 1e-4), 5: (15, 1e-4), 1: (5, 1e-4)},
        deyo={20: (10, 5e-5), 15: (10, 5e-5), 10: (1, 5e-4), 5: (0.1, 5e-3), 1: (0.1, 5e-3)},
        deyo_come={20: (10, 1e-3), 15: (5, 1e-3), 10: (1, 5e-3), 5: (5, 1e-3), 1: (0.1, 5e-3)},
    ),
    episodic=dict(
        tent={20: (1, 0.05), 15: (0.1, 0.5), 10: (0.1, 0.1), 5: (0.1, 0.1), 1: (1, 1e-3)},
        eata={20: (10, 5e-3), 15: (0.1, 0.5), 10: (0.1, 0.5), 5: (0.1, 0.1), 1: (0.1, 0.01)},
        sar={20: (1, 0.05), 15: (10, 1e-3), 10: (1, 0.01), 5: (0.1, 0.1), 1: (0.1, 0.01)},
        deyo={20: (1, 0.01), 15: (1, 0.01), 10: (10, 1e-3), 5: (0.1, 0.1), 1: (0.1, 1e-3)},
        deyo_come={20: (10, 5e-3), 15: (1, 0.05), 10: (0.1, 0.1), 5: (0.1, 0.1), 1: (0.1, 0.01)},
    ),
)
# the clip-only originals (filters kept, per-sample clip, no noise): setting -> method -> (C, lr)
PAPER_CLIP_ONLY = dict(
    continual=dict(
        tent=(0.1, 0.5), eata=(0.1, 0.5), sar=(1, 0.1), deyo=(10, 0.01), deyo_come=(20, 0.01)
    ),
    episodic=dict(
        tent=(1, 0.1), eata=(30, 5e-3), sar=(5, 0.05), deyo=(35, 5e-3), deyo_come=(20, 0.01)
    ),
)
PAPER_LR = dict(  # the non-private originals' lr
    continual=dict(tent=1e-4, eata=5e-4, sar=5e-3, deyo=5e-4, deyo_come=5e-4),
    episodic=dict(tent=1e-3, eata=1e-3, sar=5e-3, deyo=1e-3, deyo_come=1e-3),
)
# Constants the paper's scripts ran that differ from the originals' (filters only, so they
# matter for the originals and clip-only runs): SAR's E0 = 0.5·ln K, DeYO's τ_PLPD = 0.3
PAPER_CONSTANTS = dict(
    sar=dict(e_margin=0.5), deyo=dict(plpd_threshold=0.3), deyo_come=dict(plpd_threshold=0.3)
)


def paper_hparams(method, eps=math.inf, setting="continual", clip=None):
    """(C, lr, where they come from) in the paper's tables. An original with a clip, and a DP
    variant at ε = inf, take the clip-only row (clip is read only as whether there is one).
    COME alone has no row: Tent's is used. An ε the paper did not tune takes the nearest
    tuned ε on a log scale. A method the paper has no row for: (None, None, why)."""
    base, note = method.removeprefix("dp_"), ""
    if base == "come":
        base, note = "tent", "; come alone has no row: tent's"
    if base not in PAPER_LR[setting]:
        return None, None, f"no paper values for {method}"
    if not method.startswith("dp_") and clip is None:
        return None, PAPER_LR[setting][base], f"paper, {base}, {setting}{note}"
    if not method.startswith("dp_") or math.isinf(eps):
        C, lr = PAPER_CLIP_ONLY[setting][base]
        return C, lr, f"paper, clip-only {base}, {setting}{note}"
    near = min(TUNED_EPS, key=lambda e: abs(math.log(e / eps)))
    if near != eps:
        note += f"; ε={eps:g} not tuned: the nearest tuned ε (log scale)"
    C, lr = PAPER_DP[setting][base][near]
    return C, lr, f"paper, dp_{base} ε={near}, {setting}{note}"


# ----------------------------------------------------------------------------
# Data: ImageNet-C and ImageNet-R folders, labelled by WordNet id
CORRUPTIONS = (  # ImageNet-C's 15, in the customary order
    "gaussian_noise shot_noise impulse_noise defocus_blur glass_blur motion_blur zoom_blur snow "
    "frost fog brightness contrast elastic_transform pixelate jpeg_compression"
).split()
HELD_OUT = "speckle_noise gaussian_blur spatter saturate".split()  # its 4 for choosing values
STREAM_IMAGES = dict(imagenet_c=50_000, imagenet_r=30_000)  # a whole stream: a paper cell's
DEFAULT_MODEL = "vit_base_patch16_224.augreg2_in21k_ft_in1k"  # the paper's ViT-B/16 weights


class UnreadableImage(OSError):
    """An image file that PIL cannot read (empty, truncated, corrupt): the run stops."""


def read_image(path):
    """ImageFolder's loader: the image in RGB, or UnreadableImage naming its file (PIL's own
    message for a truncated file does not name it)."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as e:  # PIL raises many kinds
        raise UnreadableImage(f"{path}: {e}") from None


class WnidFolder(ImageFolder):
    """An ImageFolder whose classes are its folders but hidden ones (.ipynb_checkpoints)."""

    def find_classes(self, directory):
        classes = [c for c in super().find_classes(directory)[0] if not c.startswith(".")]
        return classes, {c: i for i, c in enumerate(classes)}


def wnid_folder(root, imagenet_labels=True):
    """A WnidFolder of <wnid>/ class folders (no image in a hidden file or folder: macOS' ._
    twins, .DS_Store). imagenet_labels: each image's label is its WordNet id's ImageNet-1k
    index (ImageNet-C, any subset of the classes); else the index of its folder among those
    present (ImageNet-R, scored on a head of those classes)."""

    def is_image(path):
        parts = os.path.relpath(path, root).split(os.sep)
        return path.lower().endswith(IMG_EXTENSIONS) and not any(p.startswith(".") for p in parts)

    folder = WnidFolder(root, loader=read_image, is_valid_file=is_image)  # refuses an empty one
    index = {wnid: i for i, wnid in enumerate(timm.data.ImageNetInfo().label_names())}
    folder.imagenet_index = [index[wnid] for wnid in folder.classes]
    if imagenet_labels:
        folder.samples = [(path, folder.imagenet_index[y]) for path, y in folder.samples]
    return folder


def open_streams(args):
    """(corruption, its WnidFolder) for each stream, every folder opened before the first image;
    no file twice in a run (a linked folder would release its images twice under a claim that
    counts each once): each is known by its device and inode, however it is linked."""
    if args.dataset == "imagenet_r":
        streams = [("imagenet_r", wnid_folder(args.data, imagenet_labels=False))]
    else:
        roots = [os.path.join(args.data, c, str(args.severity)) for c in args.corruptions]
        streams = [(c, wnid_folder(root)) for c, root in zip(args.corruptions, roots)]
    files = [os.stat(path) for _, folder in streams for path, _ in folder.samples]
    once = len({(f.st_dev, f.st_ino) for f in files}) == len(files)
    require(once, f"{args.data}: a file twice in the run (a link?); each image is shown once")
    return streams


def make_synthetic_tree(root, corruptions, severity, n, size=64, seed=0):
    """An ImageNet-C-shaped tree of random JPEGs, n per corruption over 10 wnids (smoke runs)."""
    wnids, rng = timm.data.ImageNetInfo().label_names()[:10], np.random.default_rng(seed)
    for c in corruptions:
        for i in range(n):
            folder = os.path.join(root, c, str(severity), wnids[i % len(wnids)])
            os.makedirs(folder, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.JPEG"), quality=90)


def build_model(args, streams):
    """The timm model: the Hub's weights (offline: HF_HUB_OFFLINE=1 and its cache), those of
    --checkpoint, or random ones for a smoke run; for ImageNet-R its head cut to the classes
    present (Hendrycks' mask), so that the adapter's losses see the logits that are scored."""
    torch.manual_seed(args.seed)  # a smoke run's random weights
    model = timm.create_model(args.model, pretrained=not (args.synthetic or args.checkpoint))
    if args.checkpoint:
        timm.models.load_checkpoint(model, args.checkpoint)
    if args.dataset == "imagenet_r":
        head, classes = model.get_classifier(), streams[0][1].imagenet_index
        head.weight = nn.Parameter(head.weight[classes])
        head.bias = nn.Parameter(head.bias[classes])
    return model.to(args.device)


def fisher_of(args, model, transform):
    """EATA's Fisher information on --fisher-data's clean images. They must be public:
    disjoint from the test photos, so not inside the test data's root (a Fisher of test images
    would leak them, unclipped and unnoised), and not ImageNet's validation images, which
    ImageNet-C is made from (ImageNet's train images are public in this sense)."""
    data, clean = os.path.realpath(args.data), os.path.realpath(args.fisher_data)
    require(os.path.commonpath([data, clean]) != data, "--fisher-data lies inside --data")
    folder = wnid_folder(args.fisher_data)
    folder.transform = transform
    loader = DataLoader(folder, args.batch_size, shuffle=True, num_workers=args.workers)
    return fisher_information(model, adaptable_params(model), loader, bn=args.bn)


# ----------------------------------------------------------------------------
# The command line
def fail(error):
    """A mistake in the input: one line (torch's and timm's messages run to 150), and exit 2
    (argparse's own errors too)."""
    lines = str(error).strip().splitlines()
    print(f"dptta.py: error: {lines[0] if lines else type(error).__name__}", file=sys.stderr)
    sys.exit(2)


def stop(code, what):
    """A run stopped after its first image: one line, and no run record."""
    print(f"dptta.py: {what}; no run record written", file=sys.stderr)
    return code


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def hp_value(text):
    """--hp NAME=VALUE: a finite number (NaN would open or close a filter silently)."""
    name, _, value = text.partition("=")
    value = json.loads(value)
    if not (type(value) in (int, float) and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text}: not a finite number")
    return name, value


# The flags that only some methods read: one given to another method is refused, not recorded
# as if it had changed the result. (--hp takes only the method's constants: parse_args)
DP, STEPPING = [n for n, m in METHODS.items() if m.dp], [n for n in METHODS if n != "source"]
READ_BY = dict(eps=DP, delta=DP, clip=STEPPING, lr=STEPPING, fisher_data=["eata", "dp_eata"])


def parse_args(argv=None):
    # (no abbreviations: --ep is no --eps, as the grid's check of its EXTRA reads whole flags)
    ap = argparse.ArgumentParser(description="DP test-time adaptation", allow_abbrev=False)
    ap.error = fail
    add = ap.add_argument
    add("--method", default="dp_tent", choices=list(METHODS))
    add("--eps", type=float, help="ε of a dp_ method (default 5; inf: its recipe, no noise)")
    add("--delta", type=float, default=1e-6, help="δ of a dp_ method")
    add("--clip", type=float, help="per-sample clip C (default: the paper's)")
    add("--lr", type=float, help="SGD's learning rate (default: the paper's)")
    add("--hp", type=hp_value, action="append", default=[], metavar="NAME=VALUE")
    add("--model", default=DEFAULT_MODEL, help="a timm name")
    add("--checkpoint", help="one's own weights for --model (a local file)")
    add("--data", default=os.environ.get("IMAGENET_C"), help="the root (default $IMAGENET_C)")
    add("--dataset", default="imagenet_c", choices=("imagenet_c", "imagenet_r"))
    add("--severity", type=int, default=5, choices=range(1, 6), help="ImageNet-C's")
    add("--corruptions", default=",".join(CORRUPTIONS), help="comma-separated, in order")
    # (episodic: θ0 and a fresh optimizer at each corruption, as the paper; not at each batch)
    add("--setting", default="continual", choices=("continual", "episodic"))
    add("--batch-size", type=positive_int, default=64)
    add("--accumulate", type=positive_int, default=1, help="a step per K batches")
    add("--bn", default="train", choices=("train", "source"), help="BatchNorm's statistics")
    add("--seed", type=int, default=0, help="the data order and DeYO's shuffles, not the noise")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    add("--workers", type=int, default=min(8, os.cpu_count()), help="the loader's processes")
    add("--limit", type=positive_int, help="images per corruption")
    add("--out", help="JSON lines, appended (default results.jsonl; smoke: results-smoke.jsonl)")
    add("--fisher-data", help="EATA: public clean images in <wnid>/ folders (not ImageNet val)")
    add("--synthetic", type=positive_int, metavar="N", help="a smoke run: N random images each")
    add("--summarize", metavar="JSONL", help="the paper's tables from a results file")
    add("--benchmark", action="store_true", help="time each method's plain, clip-only, DP step")
    args = ap.parse_args(argv)
    for flag, methods in READ_BY.items():
        if getattr(args, flag) != ap.get_default(flag) and args.method not in methods:
            ap.error(f"--{flag.replace('_', '-')} means nothing for {args.method}")
    # the method's constants, never an argument of DPTTA's: --hp noise_seed=0 would make the
    # noise public under a header that calls it secret
    method = METHODS[args.method]
    for name, _ in args.hp:  # (EATA's fisher, not a number, comes from --fisher-data)
        if name == "fisher" or name not in {**method.constants, **method.filter_constants}:
            ap.error(f"--hp {name}: not a number constant of {args.method}")
    args.corruptions = args.corruptions.split(",")  # ImageNet-C's names (folders), each once
    if sorted(set(args.corruptions) & {*CORRUPTIONS, *HELD_OUT}) != sorted(args.corruptions):
        ap.error(f"--corruptions: ImageNet-C's, each at most once: {','.join(args.corruptions)}")
    if args.eps is None and method.dp:
        args.eps = 5.0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no GPU")
    return args


def run_key(args, hp):
    """Every flag that can change a result: all but --workers, --out and the other commands
    (the seed too: --summarize averages over seeds; paths as given, so that another path to
    the same files is another run; the device, as bf16 on a GPU and fp32 on a CPU differ)."""
    unread = ("workers", "out", "summarize", "benchmark")
    key = {name: value for name, value in vars(args).items() if name not in unread}
    key["hp"] = hp
    if args.eps == math.inf:
        key["eps"] = "inf"  # JSON has no inf
    if args.synthetic:
        key["data"] = "synthetic"  # (a temporary folder)
    return key


def is_paper_run(args, hp):
    """Whether a run is one of the paper's cells: its C, lr and constants the paper's, on real
    data at the paper's severity, with its ViT-B/16 weights, at its δ and batch. (Its streams must be whole too: adapt counts them.)"""
    eps = math.inf if args.eps is None else args.eps
    C, lr, _ = paper_hparams(args.method, eps, args.setting, args.clip)
    base = args.method.removeprefix("dp_")
    filters = METHODS[args.method].filter_constants
    paper_hp = {k: v for k, v in PAPER_CONSTANTS.get(base, {}).items() if k in filters}
    whole = args.dataset == "imagenet_r" or args.corruptions == CORRUPTIONS
    real = not args.synthetic and args.limit is None and args.checkpoint is None
    real = real and args.model == DEFAULT_MODEL and args.severity in (5, None)  # the paper's
    plain = args.delta == 1e-6 and args.batch_size == 64 and args.accumulate == 1
    # an ε the paper tuned; not COME alone, which takes Tent's row, having none of its own
    tuned = eps in (*TUNED_EPS, math.inf) and base != "come"
    return (args.clip, args.lr, hp) == (C, lr, paper_hp) and whole and real and plain and tuned


def read_records(path):
    """The records of a JSON-lines file; a line that is no record ({"kind", "key", ...}) is
    skipped and named."""
    records = []
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:  # one rule: a JSON object with a kind and a key that is an object
                record = json.loads(line)
                records.append(dict(record, kind=record["kind"], key=dict(**record["key"])))
            except (ValueError, TypeError, KeyError):
                print(f"{path}:{number}: skipped, not a whole record")
    return records


def append_record(path, record):
    """A JSON line appended on a line of its own: after a torn last line (a killed write, a
    full disk) too, which would otherwise swallow it, and with it a run's start."""
    line = json.dumps(record).encode() + b"\n"
    with open(path, "ab+") as f:  # (opened at its end)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = b"\n" + line
        f.write(line)


def print_header(args, adapter, source):
    """What runs where, on which data, what is private, and what adapts."""
    dtype = "bf16 autocast" if args.device == "cuda" else "fp32"
    print(f"dptta | {args.method} | {args.model} | {args.device} | {dtype}")
    if args.synthetic:
        weights = "random weights" if args.checkpoint is None else args.checkpoint
        print(f"SMOKE RUN: {args.synthetic} random images per corruption, {weights}")
    k, data = len(args.corruptions), f"imagenet_c severity {args.severity}"
    data = "imagenet_r" if args.dataset == "imagenet_r" else data  # (no severities)
    print(f"data: {data} | {k} stream(s) | {args.setting} | batch {args.batch_size}")
    clip = f"C = {adapter.clip} [{source['clip']}]"
    if adapter.sigma > 0:
        sigma, mu, delta = adapter.sigma, 2 / adapter.sigma, adapter.delta
        print(f"privacy: ({adapter.eps:g}, {delta:g})-DP per test image (one stream's) | {clip}")
        print(f"  σ = {sigma:.4f}: each step, and the stream, μ-GDP with μ = 2/σ = {mu:.4f}")
        # a photo is in k streams (one per corruption), one step each: μ√k-GDP
        eps_photo = gdp_epsilon(sigma=sigma / math.sqrt(k), delta=delta - k * sampler_tail(sigma))
        print(f"  per photo in {k} stream(s): μ√{k} = {mu * math.sqrt(k):.4f}, ε = {eps_photo:.3g}")
        print("  noise: secret, from OS entropy")
    elif adapter.clip is not None:
        print(f"privacy: NONE (clip only, no noise) | {clip}")
    else:
        print("privacy: NONE")
    if adapter.params:
        n = sum(p.numel() for p in adapter.params.values())
        hp = "".join(f" | {name}={value}" for name, value in args.hp)
        print(f"lr {adapter.lr} [{source['lr']}] | SGD momentum 0.9{hp}")
        print(f"  adapting {len(adapter.params)} tensors, {n:,} scalars")
    if args.method.endswith("eata"):
        print(f"  EATA's Fisher penalty: {'on' if args.fisher_data else 'off (no --fisher-data)'}")


# ----------------------------------------------------------------------------
# A run: everything checked before the first image, then the stream
def prepare(args, tmp):
    """Every check and every choice before the first image: (adapter, loaders, key, paper),
    or None where --out holds this run's finished record already."""
    hp = dict(args.hp)
    eps = math.inf if args.eps is None else args.eps
    require(eps > 0, f"eps must be > 0 (inf: no noise), got {eps}")
    C, lr, where = paper_hparams(args.method, eps, args.setting, args.clip)
    source = dict(clip="given", lr="given")
    if args.clip is None:
        args.clip, source["clip"] = C, where
    if args.lr is None:
        args.lr, source["lr"] = lr, where
    if args.synthetic:
        args.data = tmp
        make_synthetic_tree(tmp, args.corruptions, args.severity, args.synthetic)
    require(args.data is not None, "no data: --data ROOT, $IMAGENET_C or --synthetic N")
    if args.dataset == "imagenet_r":  # one stream, and no severity: the key says so
        args.corruptions, args.severity = ["imagenet_r"], None
    if args.out is None:
        args.out = "results-smoke.jsonl" if args.synthetic else "results.jsonl"
    # a folder, /dev/null or a pipe would lose the records, /dev/full be read for ever
    require(not os.path.exists(args.out) or os.path.isfile(args.out), f"{args.out}: not a file")
    key = run_key(args, hp)
    if any(r["kind"] == "run" and r["key"] == key for r in read_records(args.out)):
        print(f"skipped: {args.out} holds this run's finished record (another --out runs it again)")
        return None
    streams = open_streams(args)
    model = build_model(args, streams)
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    loaders, cuda = [], args.device == "cuda"
    for corruption, folder in streams:
        folder.transform = transform
        order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(args.seed))
        images = Subset(folder, order[: args.limit].tolist())
        loader = DataLoader(images, args.batch_size, num_workers=args.workers, pin_memory=cuda)
        loaders.append((corruption, loader))
    if args.fisher_data:
        hp = dict(hp, fisher=fisher_of(args, model, transform))
    kwargs = dict(hp, eps=args.eps, delta=args.delta, clip=args.clip, lr=args.lr, bn=args.bn)
    adapter = DPTTA(model, args.method, accumulate=args.accumulate, seed=args.seed, **kwargs)
    print_header(args, adapter, source)
    return adapter, loaders, key, is_paper_run(args, key["hp"])


def adapt(args, adapter, loaders, key, paper):
    """Each corruption through the adapter, predicting then adapting on each batch: a record
    when the run starts (an attempt: its steps are released whether it finishes or not), one
    per corruption, then one for the finished run."""
    autocast = torch.autocast(args.device, torch.bfloat16, enabled=args.device == "cuda")
    start, top1, images = time.time(), {}, {}
    append_record(args.out, dict(kind="start", key=key, time=time.time()))  # (seconds, Unix)
    for corruption, loader in loaders:
        if args.setting == "episodic":
            adapter.reset()
        hits, seen, t0, shown = 0, 0, time.time(), time.time()
        for batch, (x, y) in enumerate(loader):
            with autocast:
                logits = adapter(x.to(args.device, non_blocking=True))
            if not all(torch.isfinite(t).all() for t in (logits, *adapter.params.values())):
                return stop(3, f"{corruption}, batch {batch}: logits or θ not finite (--lr?)")
            hits += (logits.argmax(1).cpu() == y).sum().item()
            seen += len(y)
            if time.time() - shown > 60:  # a progress line, at most one a minute
                shown = time.time()
                print(f"  {corruption}: {seen}/{len(loader.dataset)} images")
        with autocast:
            adapter.flush()  # a partial accumulate window: a step of its own
        top1[corruption], images[corruption] = 100 * hits / seen, seen
        rate = seen / (time.time() - t0)
        print(f"{corruption:<18} top-1 {top1[corruption]:5.1f}% | {seen} images | {rate:.1f} img/s")
        record = dict(kind="corruption", key=key, corruption=corruption, top1=top1[corruption])
        append_record(args.out, dict(record, images=seen))
    # a paper cell streams every image: 50,000 a corruption (ImageNet-R: 30,000)
    paper = paper and all(n == STREAM_IMAGES[args.dataset] for n in images.values())
    mean, seconds = sum(top1.values()) / len(top1), time.time() - start
    versions = dict(torch=torch.__version__, timm=timm.__version__, python=sys.version.split()[0])
    # the CPU's architecture; on CUDA, the GPU's model
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.machine()
    mu = 2 / adapter.sigma if adapter.sigma > 0 else None  # (no noise: no μ)
    record = dict(kind="run", key=key, paper=paper, mean_top1=mean, top1=top1, images=images)
    record.update(sigma=adapter.sigma, mu=mu, smoke=bool(args.synthetic), seconds=seconds)
    append_record(args.out, dict(record, versions=versions, device_name=device))
    print(f"mean top-1 {mean:.2f}% | {seconds:.0f} s | appended to {args.out}")
    return 0


# ----------------------------------------------------------------------------
# --summarize: the paper's tables, from the finished runs of a results file
def summarize(path):
    """A table per (dataset, severity, setting, model, device) of the paper's cells: a row per
    method (EATA with its Fisher penalty a row of its own), a column per variant, mean ± std
    (np.std) over seeds; the other runs (smoke, --limit, other C, lr or constants, a partial
    stream) listed apart, never in the paper's cells. A cell is the run key without the seed;
    a key finished twice counts once (its latest record). Then the attempts: the runs started
    against those finished, and each run started and never finished (its steps were released
    too) or finished twice."""
    require(os.path.isfile(path), f"--summarize {path}: no such file")
    cells, attempts = {}, {}
    for record in read_records(path):
        key = record["key"]
        attempts.setdefault(json.dumps(key, sort_keys=True), []).append(record["kind"])
        if record["kind"] == "run":
            cell = json.dumps({k: v for k, v in key.items() if k != "seed"}, sort_keys=True)
            cells.setdefault(cell, {})[key.get("seed")] = record  # the latest wins
    tables, others = {}, []
    for cell, runs in cells.items():
        key, top1 = json.loads(cell), [run["mean_top1"] for run in runs.values()]
        shown = f"{np.mean(top1):.1f} ± {np.std(top1):.1f} ({len(top1)})"
        if not all(run.get("paper") is True for run in runs.values()):
            others.append(f"  {shown}  " + " ".join(f"{k}={v}" for k, v in key.items()))
            continue
        title = f"{key['dataset']} severity {key['severity']} | {key['setting']} | {key['model']}"
        method = key["method"].removeprefix("dp_")
        if key["fisher_data"] is not None:  # EATA with its Fisher penalty: a row of its own
            method += "+fisher"
        column = "clip-only" if key["clip"] is not None else "non-private"  # an original's
        if key["method"].startswith("dp_"):
            column = f"ε={float(key['eps']):g}"  # (a number, or "inf")
        row = tables.setdefault(f"{title} | {key['device']}", {}).setdefault(method, {})
        if column in row:  # another key of this cell (another data path, --bn, Fisher images)
            others.append(f"  {shown}  (a paper cell twice) " + json.dumps(key))
            continue
        row[column] = shown
    columns = ["non-private", "clip-only"] + [f"ε={e:g}" for e in (*TUNED_EPS, math.inf)]
    order = [m.name for m in (SOURCE, *ORIGINALS)]  # the paper's rows; eata+fisher after eata
    for title, rows in tables.items():
        used = [c for c in columns if any(c in row for row in rows.values())]
        print(f"{title} | top-1 %, mean ± std (seeds)")
        print(f"{'method':<12}" + "".join(f"{c:>20}" for c in used))
        for method in sorted(rows, key=lambda name: (order.index(name.split("+")[0]), name)):
            print(f"{method:<12}" + "".join(f"{rows[method].get(c, '-'):>20}" for c in used))
    if others:
        print("other runs, not the paper's cells (mean ± std (seeds), key):")
        print("\n".join(others))
    kinds = [kind for seen in attempts.values() for kind in seen]
    print(f"attempts: {kinds.count('start')} started, {kinds.count('run')} finished")
    for key, seen in attempts.items():  # a killed run released its steps too
        started, finished = seen.count("start"), seen.count("run")
        if started > finished or finished > 1:
            print(f"  {started} started, {finished} finished: {key}")
    return 0


# --benchmark: the cost of privacy, measured side by side
def benchmark(args):
    """A step of every method, plain, clip-only and DP (ε = 5), on random weights with every
    filter open, timed side by side in interleaved rounds (the machine's drift hits every
    variant alike), with vmap's per-sample fallback off: a loop over samples would be an
    error naming its op. ViT-B/16 in bf16 at batch 64 on a GPU; by default ViT-S/16 at batch
    32 on a CPU."""
    name, batch, rounds = "vit_base_patch16_224", args.batch_size, 10
    if args.device == "cpu":
        name, batch, rounds = "vit_small_patch16_224", 32, 3
    if args.model != DEFAULT_MODEL:  # a --model given: it, at --batch-size
        name, batch = args.model, args.batch_size
    torch.manual_seed(args.seed)
    model = timm.create_model(name, pretrained=False).to(args.device)
    x = torch.randn(batch, *model.pretrained_cfg["input_size"], device=args.device)
    autocast = torch.autocast(args.device, torch.bfloat16, enabled=args.device == "cuda")
    # every filter open (H < ln K, but for a uniform softmax; PLPD >= −1) and no reset
    wide_open = dict(e_margin=1.0, d_margin=math.inf, deyo_margin=1.0, plpd_threshold=-2.0)
    wide_open.update(reset_ema=-math.inf)
    adapters = {}
    for base in ORIGINALS:
        for variant, method, kwargs in (
            ("plain", base, {}),
            ("clip-only", base, dict(clip=1.0)),
            ("DP ε=5", private(base), dict(clip=1.0, eps=5.0)),
        ):
            names = {**method.constants, **method.filter_constants}
            kwargs.update((k, v) for k, v in wide_open.items() if k in names)
            adapters[base.name, variant] = DPTTA(copy.deepcopy(model), method, lr=1e-5, **kwargs)
    times = {row: [] for row in adapters}
    torch._C._functorch._set_vmap_fallback_enabled(False)  # a loop, timed as the method: refused
    for _ in range(rounds + 1):  # the first round warms up
        for row, adapter in adapters.items():
            t0 = time.perf_counter()
            with autocast:
                adapter(x)
            torch.get_device_module(args.device).synchronize()
            times[row].append(time.perf_counter() - t0)
    print(f"benchmark | {name} | batch {batch} | {args.device} | {rounds} interleaved rounds")
    print(f"{'method':<12}{'plain ms':>10}{'clip-only':>11}{'DP ε=5':>9}  (median; ratio to plain)")
    for base in ORIGINALS:
        ms = {v: 1000 * np.median(t[1:]) for (m, v), t in times.items() if m == base.name}
        clip, dp = ms["clip-only"] / ms["plain"], ms["DP ε=5"] / ms["plain"]
        print(f"{base.name:<12}{ms['plain']:>10.1f}{clip:>11.2f}{dp:>9.2f}")
    return 0


# ----------------------------------------------------------------------------
# main
def main(argv=None):
    sys.stdout.reconfigure(line_buffering=True)  # a progress line shows when printed
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dptta-synthetic-") as tmp:
        try:  # the library's checks, a missing folder or file, weights that do not fit: exit 2
            if args.summarize:
                return summarize(args.summarize)
            if args.benchmark:
                return benchmark(args)
            run = prepare(args, tmp)
        except (ValueError, OSError, RuntimeError) as e:
            fail(e)
        try:
            return 0 if run is None else adapt(args, *run)  # None: finished already
        except UnreadableImage as e:  # (from a loader's worker: its message ends with ours)
            return stop(3, f"cannot read {str(e).splitlines()[-1].split('UnreadableImage: ')[-1]}")
        except OSError as e:  # a record that cannot be appended (a full disk), a loader's error
            return stop(3, f"stopped (a record to {args.out}, or the stream): {e}")
        except KeyboardInterrupt:
            return stop(130, f"{args.method} interrupted")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # cleans up, as Ctrl-C
    sys.exit(main())
