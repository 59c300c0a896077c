"""dptta: differentially private test-time adaptation (DP-TTA), in one file.

Test-time adaptation (Tent, EATA, SAR, DeYO, COME) tunes a model's normalization layers θ on
the unlabeled test stream, and θ then leaks the test images. DP-TTA makes every update
differentially private, so that θ and every prediction for *other* images can be released:

    g_i = ∇θ ℓ(x_i)                                       one sample's own loss
    Δ   = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B      clip, sum, noise, average
    θ  ← SGD-momentum(θ, Δ)                                post-processing: free

What is private: one test image, against streams that differ by replacing it (so one
clipped gradient moves the sum by at most 2C). A release is one noisy sum made public: a
step's Δ (dp_norm: one BatchNorm layer's moments). Each image is in one step, and later steps
see it only through θ, so the whole stream is μ-GDP with μ = 2/σ (Dong, Roth & Su 2022):
δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ). The noise is secret: drawn from a
cryptographic stream keyed from OS entropy (a known seed, or a predictable generator, would
let anyone subtract it), and kept out of every copy, pickle and checkpoint.

    python dptta.py --synthetic 16 --method dp_tent --eps 5    # a smoke run: CPU, a minute
    python dptta.py --method dp_deyo --eps 5                   # ImageNet-C, $IMAGENET_C, GPU
    adapter = DPTTA(model, "dp_tent", eps=5, clip=1.0, lr=1e-3)  # the library: Part I

Part I (to the Part II banner: the accountant, the per-sample pass, the methods, DPTTA,
DPNorm and the paper's tuned values) is the method, with torch, numpy and scipy only: copy
it. Part II streams ImageNet-C through it from the command line; the Appendix holds the
tools (--summarize, --benchmark, --audit).
"""

# ============================================================================
# Part I: DP-TTA (torch, numpy, scipy). Part II: ImageNet-C from the command line; Appendix: tools
import contextlib
import copy
import hashlib
import math
import os
import re
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


def need(ok, problem):
    """An argument check: a ValueError whose message is one line."""
    if not ok:
        raise ValueError(problem)


# ----------------------------------------------------------------------------
# Privacy accounting: one pass over the stream is μ-GDP with μ = 2/σ, so that
#   δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ).
# gdp_delta is that formula; _log_gdp_delta evaluates it in logs, where no Φ underflows;
# calibrate_sigma and gdp_epsilon invert it for σ and for ε.
EPS_MAX = 1e6  # there σ ≈ 1.4e-3 (δ = 1e-6); beyond, the root finder below loses its footing


def _check_privacy(eps=None, delta=None, sigma=None):
    """Arguments of the accountant; NaN fails every comparison, so it is refused too."""
    need(eps is None or eps > 0, f"eps must be > 0 (inf: no noise), got {eps}")
    need(eps is None or eps <= EPS_MAX or math.isinf(eps), f"eps must be <= {EPS_MAX:g} or inf")
    need(delta is None or 0 < delta < 1, f"delta must be in (0, 1), got {delta}")
    need(sigma is None or sigma >= 0, f"sigma must be >= 0, got {sigma}")


def _log_gdp_delta(eps, sigma):
    """log δ(ε) of μ-GDP, μ = 2/σ, computed so that no Φ underflows.

    δ = Φ(x) − e^ε Φ(x − μ) with x = −ε/μ + μ/2. In logs, log δ = log Φ(x) + log(1 − e^−D)
    where D = log Φ(x) − ε − log Φ(x − μ) > 0: both logs stay finite for large ε and tiny δ.
    For large σ the two terms of D nearly cancel; then D is integrated instead,
    D = ∫_{x−μ}^{x} (φ(u)/Φ(u) + u) du, by a 16-point Gauss-Legendre rule (exact to rounding).
    """
    mu = 2 / sigma
    x = -eps / mu + mu / 2
    log_phi = special.log_ndtr(x)
    D = log_phi - eps - special.log_ndtr(x - mu)
    if D < 0.1:  # the difference has lost digits to cancellation: integrate it instead
        nodes, weights = np.polynomial.legendre.leggauss(16)
        u = x - mu / 2 + nodes * mu / 2  # [x − μ, x] mapped to Legendre's [−1, 1]: du = μ/2 dt
        mills = np.exp(-(u**2) / 2 - math.log(2 * math.pi) / 2 - special.log_ndtr(u))  # φ(u)/Φ(u)
        D = mu / 2 * np.sum(weights * (mills + u))  # ∫ (φ(u)/Φ(u) + u) du
    if not D > 0:  # rounding, only where Φ(x) < 1e-300: δ <= Φ(x) is the safe side
        return log_phi
    return log_phi + np.log(-np.expm1(-D))


def gdp_delta(*, eps, sigma):
    """δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ): a sum of sensitivity 2C with Gaussian
    noise of standard deviation σC is (2/σ)-GDP (Dong, Roth & Su 2022, Cor. 2.13)."""
    _check_privacy(eps=eps, sigma=sigma)
    if sigma == 0:
        return 1.0
    if math.isinf(eps) or math.isinf(sigma):
        return 0.0
    return float(np.exp(_log_gdp_delta(eps, sigma)))


def _smallest(f, lo, hi):
    """The smallest x with f(x) <= 0 for a decreasing f, never a hair short of it."""
    while f(lo) < 0:
        lo /= 2
    while f(hi) > 0:
        hi *= 2
    x = optimize.brentq(f, lo, hi, xtol=1e-300, rtol=1e-12)
    while f(x) > 0:
        x *= 1 + 1e-10
    return float(x)


def _relative_excess(eps, sigma, delta):
    """δ(ε)/δ − 1, computed as gdp_delta computes δ: <= 0 exactly where δ(ε) <= δ."""
    with np.errstate(over="ignore"):  # below a subnormal δ (1e-320) the ratio is inf: still > 0
        return np.exp(_log_gdp_delta(eps, sigma)) / delta - 1


def calibrate_sigma(*, eps, delta, repeats=1):
    """The smallest σ with δ(ε) <= delta for `repeats` releases of each unit: k releases of
    (2/σ)-GDP compose to (2√k/σ)-GDP (ibid., Cor. 3.3), so σ = √k·σ_1. eps = inf: σ = 0.
    The root is found on δ as gdp_delta computes it, so the σ returned meets delta exactly."""
    _check_privacy(eps=eps, delta=delta)
    need(isinstance(repeats, int) and repeats >= 1, "repeats must be an int >= 1")
    if math.isinf(eps):
        return 0.0
    sigma = _smallest(lambda s: _relative_excess(eps, s, delta), 0.1, 1.0)
    return sigma * math.sqrt(repeats)


def gdp_epsilon(*, sigma, delta):
    """The smallest ε with δ(ε) <= delta at noise σ; inf for σ = 0 (no noise)."""
    _check_privacy(delta=delta, sigma=sigma)
    if sigma == 0:
        return math.inf
    f = partial(_relative_excess, sigma=sigma, delta=delta)
    # σ = inf is all noise: nothing is told (f is not called there: it would divide by μ = 0).
    # Otherwise ε = 0 where it already meets delta (the root finder below halves its lower end:
    # 0 would never move)
    if math.isinf(sigma) or f(0.0) <= 0:
        return 0.0
    return _smallest(f, 0.0, 1.0)


# ----------------------------------------------------------------------------
# What adapts: the norm layers' affine parameters θ
BATCH_NORM = nn.modules.batchnorm._BatchNorm  # timm's BatchNormAct2d is one too
# The adaptable norm layers, with their subclasses (timm's LayerNorm2d, GroupNorm1, BatchNormAct2d).
# timm's own RmsNorm, SimpleNorm and EvoNorm subclass none of them: add them here to adapt them.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm, BATCH_NORM)


def couples_samples(module):
    """A BatchNorm that normalizes with the batch itself: in train mode, or without running
    statistics (track_running_stats=False uses the batch even in eval mode). Through it a
    sample's output, and so its gradient, depends on every other sample of the batch."""
    return isinstance(module, BATCH_NORM) and (module.training or module.running_mean is None)


def refuse_coupled_samples(model, why):
    """A ValueError naming the model's BatchNorm layers that couple the samples, if any."""
    coupled = [n for n, m in model.named_modules() if couples_samples(m)]  # (the model: "")
    mode = "in train mode or without running statistics couples the batch"
    need(not coupled, f"BatchNorm {coupled} {mode}: {why}")


def _trunk_cut(model):
    """The name of the module where the trunk's top starts; SAR and DeYO adapt the norms
    registered before it. The trunk is the first container (Sequential, ModuleList) named
    - blocks (timm ViT, DeiT, BEiT, EVA, CaiT, XCiT) or layer (Hugging Face ViT): its last
      3 are the top (ViT-B/16: blocks 0-8 are adapted, as SAR and DeYO do);
    - layers: the last 3 of 6 or more blocks (torchvision ViT), else its last stage (timm
      and Hugging Face Swin);
    - stages (ConvNeXt, PVT, EdgeNeXt, MobileViT, Hugging Face ResNet) or features
      (torchvision ConvNeXt, Swin): its last stage;
    or else ResNet's layer1..layerN: the last, as the originals' ResNets. None: no trunk is
    recognized, and every norm is adapted."""
    layers = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        trunk = leaf in ("blocks", "layer", "layers", "stages", "features")
        if trunk and isinstance(module, (nn.Sequential, nn.ModuleList)):
            by_block = leaf in ("blocks", "layer") or (leaf == "layers" and len(module) >= 6)
            top = 3 if by_block else 1  # the top: the last 3 blocks, or the last stage
            if len(module) > top:  # a Sequential built from a dict names its items
                return f"{name}.{list(module._modules)[-top]}"
        if re.fullmatch(r"layer\d+", leaf) and isinstance(module, nn.Sequential):
            layers.append((int(leaf[5:]), name))
    if len(layers) > 1:
        return max(layers)[1]
    return None


def adaptable_params(model, *, skip_top=False, per_sample=True):
    """{name: parameter} of the norm layers' affine parameters, in the model's order.

    skip_top: only those below the trunk's top (SAR, DeYO; see _trunk_cut). per_sample: refuse a
    model with BatchNorm, as per-sample gradients in batch-statistics mode need (in train mode it
    mixes the samples); DPTTA passes False where bn="source" freezes it at its source statistics, a
    per-sample map. A tensor tied to two modules (one tensor, two names) is adapted once, under its
    first name."""
    bn = [n for n, m in model.named_modules() if isinstance(m, BATCH_NORM)]  # (the model: "")
    why = f"BatchNorm {bn} mixes the samples of a batch: no per-sample gradients (dp_, clip)"
    need(not (per_sample and bn), why + '; bn="source" freezes it at its source statistics')
    cut = _trunk_cut(model) if skip_top else None
    params, seen = {}, set()
    for name, module in model.named_modules():
        if name == cut:
            break
        if isinstance(module, NORMS):
            for leaf, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    params[f"{name}.{leaf}"] = p
    need(params, "the model has no norm-layer affine parameters to adapt")
    return params


# ----------------------------------------------------------------------------
# Per-sample gradients on torch.func: one batched pass, no per-sample loop
def logits_of(out):
    """The logits [B, K] in a model's output: the output itself, its .logits, or its
    ["logits"] (a Hugging Face ModelOutput)."""
    z = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", out)
    if not isinstance(z, torch.Tensor):
        kind = type(out).__name__
        raise TypeError(f"the model returned a {kind}; DPTTA needs logits [B, K] or .logits")
    return z


def _without_fallback(fn):
    """fn() with vmap's per-sample fallback made an error, so that no pass loops over samples
    unseen. An op that needs the fallback is warned about (Python shows a warning once) and
    run again with it, exact but slow, unless the caller had switched the fallback off
    itself (the test suite does). The switch is private torch API: a torch without it runs
    fn(), and says so."""
    functorch = getattr(torch._C, "_functorch", None)
    if not hasattr(functorch, "_set_vmap_fallback_enabled"):
        warnings.warn("this torch cannot switch vmap's fallback off: no loop certified")
        return fn()
    allowed = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        return fn()
    except RuntimeError as e:
        op = re.search(r"(\S+) hit the vmap fallback", str(e))
        if not (op and allowed):
            raise
    finally:
        functorch._set_vmap_fallback_enabled(allowed)
    warnings.warn(f"{op[1]} has no vmap rule: it runs once per sample (exact, slow)", stacklevel=3)
    return fn()


def per_sample_grads(model, params, loss_fn, x, ctx=None, *, chunk_size=None):
    """Every sample's own gradient, and the logits: ({name: g [B, *shape]}, logits [B, K]).

    g_i = ∇θ loss_fn(f_θ(x_i), ctx_i), where loss_fn maps (logits [N, K], ctx [N, ...] or
    None) to one loss per sample, [N]; ctx is the loss's other input, row i sample i's own
    (DeYO's softmax of the shuffled x′_i). DPTTA passes its method's loss with the constants
    bound (DPTTA.loss: a Method's loss takes (logits, ctx, hp)).

    The trick. The textbook way, vmap(grad(ℓ)) over the batch, runs autograd *inside* vmap, and the
    backward of GPU's fused attention kernels (flash, efficient, cuDNN) has no batching rule:
    ViT-B/16 at batch 64 would call it 64 × 12 times per step, one image at a time. Instead every
    sample gets its own view θ_i of the parameters ([B, *shape], an expand: nothing is copied), the
    forward runs under vmap over (θ_i, x_i), and ONE ordinary backward of Σ_i ℓ_i (one per chunk,
    below) gives every g_i at once: ℓ_i is the only term that touches θ_i, so ∂(Σ_j ℓ_j)/∂θ_i = ∇ℓ_i
    exactly. Autograd then runs each backward kernel once on the whole batch. The batch goes through
    in one piece on a GPU and in chunks of 8 on a CPU, where they stay in cache (ViT-S/16, batch 32:
    1.01x Tent's step, the README's Speed table; the whole batch in one piece, 1.42x).

    A sample's gradient must not depend on the others: a BatchNorm that normalizes with the
    batch is refused. Ops without a batching rule are swapped for exact equivalents during
    the pass (SDPA's math kernel on CPU, nn.MultiheadAttention without its fast path,
    adaptive pooling fed a contiguous input), and vmap's per-sample fallback is made an
    error (_without_fallback)."""
    refuse_coupled_samples(model, "no per-sample gradients")
    frozen = {n: t.detach() for n, t in model.named_parameters() if n not in params}
    frozen.update(model.named_buffers())
    if chunk_size is None:  # the whole batch on a GPU; on a CPU 8, which stay in cache
        chunk_size = 8 if x.device.type == "cpu" else len(x)

    def loss_one(theta_i, xi, ci):  # under vmap: one sample and its own view θ_i
        logits = logits_of(functional_call(model, (theta_i, frozen), (xi[None],)))
        return loss_fn(logits, None if ctx is None else ci[None])[0], logits[0]

    def batched_pass():
        ctxs = x.new_zeros(len(x), 0) if ctx is None else ctx  # vmap needs a tensor to map
        grads, logits = [], []
        for xs, cs in zip(x.split(chunk_size), ctxs.split(chunk_size)):
            theta = {n: p.detach().expand(len(xs), *p.shape) for n, p in params.items()}
            theta = {n: t.requires_grad_() for n, t in theta.items()}  # θ_i views: no copy
            losses, z = vmap(loss_one)(theta, xs, cs)
            g = torch.autograd.grad(losses.sum(), list(theta.values()), materialize_grads=True)
            grads.append(g)
            logits.append(z.detach())
        return {n: torch.cat(g) for n, g in zip(params, zip(*grads))}, torch.cat(logits)

    with contextlib.ExitStack() as swaps:  # each restored on exit, an exception included
        if x.device.type == "cpu":  # fused CPU attention cannot batch even its forward
            swaps.enter_context(sdpa_kernel(SDPBackend.MATH))
        mha = torch.backends.mha  # MultiheadAttention's eval fast path: no vmap rule, no grad
        swaps.callback(mha.set_fastpath_enabled, mha.get_fastpath_enabled())
        mha.set_fastpath_enabled(False)
        for m in model.modules():  # adaptive pooling of a channels-last input: as_strided_
            if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
                swaps.enter_context(m.register_forward_pre_hook(lambda _, a: a[0].contiguous()))
        return _without_fallback(batched_pass)


# ----------------------------------------------------------------------------
# Clip and noise: the Gaussian mechanism on the sum of clipped gradients
class NoiseStream:
    """The privacy noise's source: N(0, 1) draws from a cryptographic stream, SHAKE-256 keyed
    by 32 bytes from the OS. The key is the secret: whoever knows it regenerates the noise
    and subtracts it from every release.

    Why a cryptographic stream and not torch's generator: the noise is all but visible. DP's
    adversary knows every image but one, so it knows each release up to that image's clipped
    gradient, of norm <= C over all coordinates, against noise σC in *each*: it reads every
    draw to within a fraction of a standard deviation. torch's CPU mt19937 gives its whole
    state away to such readings (its output bits are linear in its state bits), and with it
    every draw, past and future; CUDA's Philox has a 64-bit key. (Opacus' secure_mode is for
    this.) Block k of the stream is SHAKE-256(key ‖ k), one block per call of normal() (a
    release), so the state is (key, k): the runner saves it to replay a killed stream. A
    stream is never copied or pickled (a copy would draw the same noise twice).

    A forked process would inherit the key and the count, and draw its parent's noise: a
    stream draws only in the process that keyed it.

    seed: an exact replay for tests and debugging, NOT private against anyone who knows it."""

    def __init__(self, seed=None):
        if seed is None:
            self.key = os.urandom(32)
        else:
            self.key = hashlib.sha256(b"dptta noise seed %d" % seed).digest()
        self.blocks, self.pid, self.lock = 0, os.getpid(), threading.Lock()

    def normal(self, n, device="cpu", dtype=torch.float32):
        """The next block: n draws of N(0, 1), by Box-Muller in float64 on uniforms u1, made of
        106 random bits (resolution 2^-106 near 0, where the radius is large: u1 >= 2^-107,
        so that the radius reaches NOISE_RADIUS), and u2 of 53 bits."""
        if os.getpid() != self.pid:
            forked = "a NoiseStream in a forked process would draw its parent's noise"
            raise RuntimeError(forked + ": build the adapter, or copy.deepcopy it, in the child")
        with self.lock:  # two threads must never draw one block
            index, self.blocks = self.blocks, self.blocks + 1
        pairs = (n + 1) // 2
        block = hashlib.shake_256(self.key + index.to_bytes(8, "little"))
        words = np.frombuffer(block.digest(24 * pairs), np.uint64) >> np.uint64(11)  # 53 bits
        high, low, angle_bits = words.astype(np.float64).reshape(3, pairs)
        u1 = (high + (low + 0.5) / 2.0**53) / 2.0**53  # in (0, 1]: log(u1) is finite
        u2 = (angle_bits + 0.5) / 2.0**53
        # z = √(−2 ln u1)·(cos 2πu2, sin 2πu2): two independent N(0, 1) per pair (u1, u2)
        radius, angle = np.sqrt(-2 * np.log(u1)), 2 * math.pi * u2
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
        z = torch.from_numpy(z).to(dtype)
        if torch.device(device).type == "cuda":  # from pinned memory the copy waits for no kernel
            z = z.pin_memory()
        return z.to(device, non_blocking=True)

    def get_state(self):
        """The secret: the key and the blocks drawn. Keep it as private as the data."""
        return dict(key=self.key, blocks=self.blocks)

    def set_state(self, state):
        self.key, self.blocks = state["key"], state["blocks"]

    def __reduce_ex__(self, protocol):
        raise TypeError("a NoiseStream is never copied or pickled: the copy would draw its noise")


# The sampler's reach: a Box-Muller pair lies within radius √(−2 ln u1) <= √(−2 ln 2^-107)
NOISE_RADIUS = math.sqrt(-2 * math.log(2.0**-107))  # 12.18


def check_noise_reach(sigma, delta, releases):
    """The accountant assumes Gaussian noise without end; the sampler's ends. Each Box-Muller pair
    of coordinates has radius at most R = NOISE_RADIUS (in units of σC). A neighbour's release is
    the same sum moved by 2C, μ = 2/σ in those units. If a pair of this world's noise has radius
    above R − μ (a Rayleigh tail: chance exp(−(R − μ)²/2) per release), the neighbour would need a
    radius above R to produce the same release, which the sampler never draws: the two worlds are
    told apart with certainty. Refused unless that chance, summed over an image's releases, is at
    most δ/1000 (at δ = 1e-6: ε up to about 43)."""
    if sigma == 0:
        return
    mu = 2 / sigma
    tail = releases * math.exp(-((NOISE_RADIUS - mu) ** 2) / 2) if mu < NOISE_RADIUS else 1.0
    reach = f"its noise ends at {NOISE_RADIUS:.2f}σC, past which a release shows its neighbour"
    too_small = f"σ = {sigma:.4g} is too small for the sampler: {reach} with chance {tail:.1e}"
    need(tail <= delta / 1000, f"{too_small} > delta/1000; use a smaller eps or a larger delta")


FP32_MAX = torch.finfo(torch.float32).max  # C and lr meet θ in fp32: a larger one overflows
FP32_TINY = torch.finfo(torch.float32).tiny  # and a C below fp32's normal numbers underflows
# The release's lattice: the clipped sum and the noise are rounded to multiples of a power of
# two γ with γ·√d <= η·2C, η = LATTICE (d: the release's coordinates); the noise is (1 + η)σC,
# 0.1% more than σC (the paper's scripts round σ up by 0.3-1.7%)
LATTICE = 2.0**-10


def at_least_fp32(t):
    """bf16 and fp16 to fp32 (fp32 and fp64 kept): a rounded clip factor can push a norm over
    C, and bf16 noise is too coarse to be Gaussian."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def clip_and_noise(grads, clip, sigma, noise_stream, tally=None):
    """Δ = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B, over {name: [B, ...]} per-sample tensors.

    One norm ‖g_i‖ over all tensors (sample i is clipped as a whole), so replacing one sample moves
    the sum by at most 2C: the noise is calibrated to the sum, then divided by B (noise added after
    dividing would be B times too small). Fresh noise, N(0, σ²C²) but for the lattice's 0.1% (the
    comment on the noise, below), for every coordinate of every tensor, from noise_stream (a
    NoiseStream). A non-finite g_i counts as zero, a decision that reads sample i alone and keeps
    the sensitivity at 2C; tally["nonfinite"] counts them.

    Δ is returned in the gradients' dtype (at least fp32), itself post-processing."""
    dtypes = {n: at_least_fp32(t).dtype for n, t in grads.items()}
    g = {n: t.double() for n, t in grads.items()}
    norms = torch.stack([t.flatten(1).pow(2).sum(1) for t in g.values()]).sum(0).sqrt()
    finite = torch.isfinite(norms)
    factor = (clip / norms.clamp(min=1e-12)).clamp(max=1.0)  # min(1, C/‖g_i‖)
    if tally is not None:
        tally["nonfinite"] = tally.get("nonfinite", 0) + (~finite).sum()
    totals = {}
    for name, t in g.items():
        shape = (-1,) + (1,) * (t.dim() - 1)  # a [B] vector, broadcast over t
        # a non-finite g_i is selected away, not scaled by 0: NaN·0 is NaN
        totals[name] = torch.where(finite.view(shape), factor.view(shape) * t, 0.0).sum(0)
    # Floating point. Float noise takes float values only, and t + z rounds on a grid that
    # depends on t: an adversary who computes the sum t of each candidate world can find a
    # coordinate of the release that the sampler could not have produced in one of them, and name
    # the image with certainty (Mironov 2012). So the sum S is computed in float64 (its rounding,
    # about B²·2^-53 of C, is far below γ) and rounded to S_γ, a multiple of γ, and so is the
    # noise: the release S_γ + round_γ(Z) = round_γ(S_γ + Z), Z ~ N(0, (1 + η)²σ²C²I), is the
    # Gaussian mechanism on S_γ rounded (post-processing), on the same lattice in every world,
    # computed exactly (integers below 2^53 times a power of two). Replacing one sample moves S_γ
    # by at most 2C + γ·√d <= 2C(1 + η), and the noise's 1 + η keeps μ = 2/σ. A zero is +0.0
    # (round() gives −0.0 for (−½, 0), and −0.0 + −0.0 keeps its sign: it would show that S_γ
    # rounded from below). What remains unaccounted is the float64 sampler against the ideal
    # Gaussian within a lattice cell: its error, about 21·2^-53 in z, against a cell γ ≈
    # 2^-9·C/√d (ViT-B/16's d = 38,000 at ε = 5: 2^-18σC) changes each cell's chance by about
    # 2^-30 relative, at most about 1e-4 in ε over all coordinates (4e-4 at ε = 1).
    if sigma > 0:  # one block of the stream for the whole release (one copy to a GPU)
        need(FP32_TINY <= clip <= FP32_MAX, f"clip must be in fp32's normal range, got {clip}")
        sizes = [t.numel() for t in totals.values()]
        # γ: the largest power of two with γ·√d <= η·2C
        gamma = 2.0 ** math.floor(math.log2(2 * LATTICE * clip / math.sqrt(sum(sizes))))
        scale = (1 + LATTICE) * sigma * (clip / gamma)  # the noise's standard deviation, in γ
        device = next(iter(totals.values())).device
        noise = noise_stream.normal(sum(sizes), device, torch.float64).split(sizes)
        for (name, total), z in zip(totals.items(), noise):
            # S_γ + round_γ(Z), in multiples of γ: integers, exact in float64
            multiples = torch.round(total / gamma) + torch.round(scale * z.view_as(total))
            totals[name] = (multiples + 0.0) * gamma  # −0.0 + 0.0 = +0.0
    batch = len(norms)  # B, the divisor: every sample, a non-finite one too
    return {name: (total / batch).to(dtypes[name]) for name, total in totals.items()}


# ----------------------------------------------------------------------------
# The losses, one value per sample: logits [N, K] -> [N]
def entropy(logits):
    """H(p) = −Σ_k p_k log p_k with p = softmax(z), in fp32 or better."""
    logp = at_least_fp32(logits).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def come_entropy(logits, num_classes=None):
    """COME's loss: the entropy of the Dirichlet opinion (b, u) instead of the softmax.

    z ← z/‖z‖·stopgrad(‖z‖) keeps z's value and takes away the gradient along z (the loss
    cannot be lowered by inflating the logits); then with e = exp(z) and S = Σe + K,
    b = e/S, u = K/S, i.e. [b, u] = softmax([z, ln K]) (computed so, with no overflow), and
    the loss is −Σ_{j=1}^{K+1} q_j log q_j for q = [b, u] + 1e-7. K: num_classes, or the
    logits' (the paper's ImageNet-R runs score 200 logits with K = 1000)."""
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


# ----------------------------------------------------------------------------
# The methods, as data: one record each, in the order of the method table
@dataclass(frozen=True)
class Method:
    """A test-time adaptation method, as data; DPTTA runs any such record.

    name      the method's name in records and tables
    loss      ℓ_i(logits [N, K], ctx, hp) -> [N]: each sample's own loss, whose gradient is
              clipped per sample
    filter    the original's data-dependent filter, a pure function
              (logits, ctx, state, hp) -> (keep [N] bool, new state); the step stores the state
    context   (model, x, generator, hp) -> ctx: ℓ_i's input besides the logits (DeYO's x′).
              Row i must come from image i alone (DeYO's does): a DP variant's sensitivity
              2C rests on it, and nothing can check it (a context may draw random numbers)
    norms     "all", or "lower": the norms below the trunk's top (SAR, DeYO)
    penalty   (θ, θ0, hp) -> {name: gradient} of a data-free term, added after the noise, or
              None where the term is off (EATA without Fisher data)
    step      "plain", "sam" (SAR's sharpness-aware step; its DP variant is DP-SAT), "norm"
              (BatchNorm statistics, no gradient) or "none" (predict only)
    constants the defaults of the constants (hp) that loss, context, penalty and step read;
              filter_constants those of the original's data-dependent decisions: its filter,
              and SAR's recovery (reset_ema). The DP variant drops them with the filter; its
              step never recovers (a reset decided on a batch's entropy would be a release)
    private   whether it is a DP variant; private(method) makes one by the paper's recipe:
              no filter, ℓ_i clipped and noised, the penalty after the noise, SAM's ascent
              along the previous private gradient (DP-SAT, Park et al. 2023)"""

    name: str
    loss: Callable = None
    filter: Callable = None
    context: Callable = None
    norms: str = "all"
    penalty: Callable = None
    step: str = "plain"
    constants: dict = field(default_factory=dict)
    filter_constants: dict = field(default_factory=dict)
    private: bool = False

    def __post_init__(self):
        need(self.norms in ("all", "lower"), f"{self.name}: norms is 'all' or 'lower'")
        need(self.step in ("plain", "sam", "norm", "none"), f"{self.name}: an unknown step")
        need(self.loss is not None or self.step in ("norm", "none"), f"{self.name} needs a loss")
        # a filter reads other samples and makes the divisor data: never inside a private step
        need(not (self.private and self.filter), f"{self.name}: a private method has no filter")


def private(method):
    """The DP variant of a method: whether sample i counts must not depend on sample j (and
    how many are kept is itself data), so the filter goes, with the constants only it read.
    SAR's recovery reads reset_ema, which goes with them: DP-SAT has none (the paper's)."""
    return replace(method, name="dp_" + method.name, filter=None, filter_constants={}, private=True)


def num_classes(logits, hp):
    """K: the constant num_classes if set, else the logits' (ln K scales every margin)."""
    return logits.shape[-1] if hp.get("num_classes") is None else hp["num_classes"]


def tent_loss(logits, ctx, hp):
    return entropy(logits)  # ℓ_i = H(x_i)


def come_loss(logits, ctx, hp):
    return come_entropy(logits, num_classes(logits, hp))  # ℓ_i = H_come(x_i)


def weighted_loss(logits, ctx, hp, entropy_loss=tent_loss):
    """EATA's and DeYO's ℓ_i = w_i·H_i, the weight detached: w = exp(E0 − H) with
    E0 = e_margin·ln K, plus DeYO's e^PLPD when ctx holds the shuffled view's softmax.
    entropy_loss: the entropy H (DeYO-COME: COME's)."""
    H = entropy_loss(logits, ctx, hp)
    w = torch.exp(hp["e_margin"] * math.log(num_classes(logits, hp)) - H.detach())
    if ctx is not None:
        w = w + torch.exp(plpd(logits, ctx))
    return w * H


def reliable(H, logits, hp, margin):
    """The originals' entropy filter: H < margin·ln K."""
    return H < hp[margin] * math.log(num_classes(logits, hp))


def sar_filter(logits, ctx, state, hp):
    return reliable(entropy(logits), logits, hp, "e_margin"), state


def eata_filter(logits, ctx, state, hp):
    """Reliable (H < E0) and not redundant with the recent samples: |cos(m, p)| < d, where m
    is the moving average of kept softmaxes, m ← 0.9·m + 0.1·mean(p of kept)."""
    keep = reliable(entropy(logits), logits, hp, "e_margin")
    p = at_least_fp32(logits).softmax(-1)
    m = state.get("m")
    if m is not None:
        keep = keep & (torch.cosine_similarity(m[None], p, 1).abs() < hp["d_margin"])
    if keep.any():
        mean = p[keep].mean(0)
        state = {**state, "m": mean if m is None else 0.9 * m + 0.1 * mean}
    return keep, state


def deyo_filter(logits, ctx, state, hp, entropy_loss=tent_loss):
    """Reliable (H < deyo_margin·ln K) and shape-dependent (PLPD > plpd_threshold)."""
    keep = reliable(entropy_loss(logits, ctx, hp), logits, hp, "deyo_margin")
    return keep & (plpd(logits, ctx) > hp["plpd_threshold"]), state


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


def fisher_penalty(theta, theta0, hp):
    """EATA's anti-forgetting term λ·Σ F(θ − θ0)², whose gradient is 2λF(θ − θ0): it reads θ,
    θ0 and F from public clean images only, so it is added after the noise, unclipped."""
    if hp["fisher"] is None:
        return None
    drift = {n: p.detach() - theta0[n] for n, p in theta.items()}
    return {n: 2 * hp["fisher_lambda"] * hp["fisher"][n] * d for n, d in drift.items()}


def fisher_information(model, params, images, n=2000):
    """EATA's F on n clean images, as EATA's code computes it: the mean over batches of the
    squared gradient of the batch's mean CE(f(x), argmax f(x)) (a batch's gradient squared,
    not each sample's). The DPTTA of dp_eata or eata takes it as its constant fisher."""
    p = {k: t.detach().requires_grad_() for k, t in params.items()}
    fisher, batches, seen = {k: torch.zeros_like(t) for k, t in p.items()}, 0, 0
    for x in images:
        x = x[: n - seen]
        logits = logits_of(functional_call(model, p, (x,)))
        loss = F.cross_entropy(logits, logits.argmax(1))
        for k, g in zip(p, torch.autograd.grad(loss, list(p.values()))):
            fisher[k] += g**2
        batches, seen = batches + 1, seen + len(x)
        if seen >= n:
            break
    return {k: f / max(batches, 1) for k, f in fisher.items()}


# Tent (Wang et al. 2021), EATA (Niu et al. 2022), SAR (Niu et al. 2023), DeYO (Lee et al.
# 2024), COME (Zhang et al. 2025). H: softmax entropy; H_come: COME's; E0 = e_margin·ln K;
# "lower": the norms below the trunk's top
# method     per-sample loss ℓ_i          original's filter            norms  extra
# tent       H                            -                            all    -
# come       H_come                       -                            all    -
# eata       exp(E0 − H)·H                H < E0, |cos(m, p)| < d      all    λ·ΣF(θ − θ0)²
# sar        H                            H < E0; reset on collapse    lower  SAM, ρ·g/‖g‖
# deyo       (exp(E0 − H) + e^PLPD)·H     H < deyo_margin·ln K, PLPD   lower  x′: shuffled
# deyo_come  as deyo, H_come for H        as deyo, with H_come         lower  as deyo
# dp_<one of them>: the same ℓ_i clipped and noised, no filter; SAR's ascent along the last Δ
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
# norm: BatchNorm layers normalize with the test batch (Schneider et al. 2020); dp_norm releases
# those statistics privately instead (DPNorm, after DPTTA)
# (bn_layers: how many of the BatchNorm layers, from the input; bn_scale: dp_norm's clip)
NORM = Method("norm", step="norm", constants=dict(bn_layers=None))
DP_NORM = replace(private(NORM), constants=dict(NORM.constants, bn_scale=0.5))
ORIGINALS = (TENT, COME, EATA, SAR, DEYO, DEYO_COME)
BASES = tuple(m.name for m in ORIGINALS)  # the originals' names; "dp_" + one: its DP variant
METHODS = {m.name: m for m in (SOURCE, *ORIGINALS, *map(private, ORIGINALS), NORM, DP_NORM)}
CONSTANTS = {k for m in METHODS.values() for k in (*m.constants, *m.filter_constants)}
# ----------------------------------------------------------------------------
# The adapter
_ADAPTED = weakref.WeakValueDictionary()  # id(parameter) -> the live adapter of its model


def method_of(method):
    """A Method record, from itself or its name."""
    if isinstance(method, Method):
        return method
    need(method in METHODS, f"unknown method {method!r}; one of {', '.join(METHODS)}")
    return METHODS[method]


class DPTTA(nn.Module):
    """A test-time adapter: forward(x) returns x's logits, predicted with the current θ, then
    adapts θ on x (with accumulate=k, once k batches have come; DPNorm: releases the batch's
    statistics, then predicts with them).

    method     a Method record, or its name: "source", an original ("tent", "come", "eata",
               "sar", "deyo", "deyo_come"), its DP variant "dp_<name>"; "norm" and "dp_norm"
               make a DPNorm (BatchNorm statistics, no gradient)
    eps, delta the DP variants' (ε, δ; δ = 1e-6 by default); eps=inf: the DP recipe with no
               noise (clip only, and no filter: the paper's "clip-only" is the original with a
               clip, filters kept)
    clip       the per-sample clip C (needed by dp_; on an original: its clip-only variant)
    lr         SGD's learning rate (momentum 0.9, as every original)
    repeats    how many steps see each privacy unit (a photo in k streams, --repeat): σ·√k
    bn         BatchNorm normalizes with the test batch ("train", Tent's: not per-sample) or
               is frozen at its source statistics ("source", a per-sample map)
    accumulate a step per k batches, on the k batches together (single-image streams)
    seed       DeYO's patch shuffles. The noise is secret, from OS entropy, unless noise_seed
               is given: an exact replay, NOT private against anyone who knows it
    chunk_size samples per vmapped chunk (default: the batch on a GPU, 8 on a CPU)
    constants  the method's constants that differ from its defaults (EATA's fisher, made by
               fisher_information(model, adaptable_params(model), clean_batches); e_margin,
               ...); a constant that another method reads is accepted and ignored
    sigma      (an attribute) the noise per release: σ(ε, δ) for DPTTA, σ_l = √L·σ for each of
               DPNorm's L releases an image (its ε: gdp_epsilon(sigma=sigma/√releases))

    reset() goes back to the source (θ, optimizer, method state; never the noise); flush()
    steps on a pending accumulate window. replay, a dict, makes each batch's per-sample pass
    run once (the audit's seam: its trials repeat only clip, noise and step; unrelated to
    noise_seed's replay of the noise and to --resume's of a killed stream)."""

    # {layer: (μ_src, σ²_src)} of the layers whose statistics are released: dp_norm's (set in
    # DPNorm.__init__; empty here and in norm), which reset() and the runner read
    bn_src = {}

    def __new__(cls, model=None, method="source", **kwargs):
        if cls is DPTTA and method_of(method).step == "norm":
            cls = DPNorm  # as pathlib.Path makes a PosixPath: DPTTA(model, "dp_norm") works
        return super().__new__(cls)

    def __init__(
        self,
        model,
        method,
        *,
        eps=None,
        delta=1e-6,
        clip=None,
        lr=None,
        repeats=1,
        bn="train",
        accumulate=1,
        seed=0,
        noise_seed=None,
        chunk_size=None,
        **constants,
    ):
        super().__init__()
        self.method = method = method_of(method)
        name, by_gradient = method.name, method.step in ("plain", "sam")  # θ moves by SGD
        need(eps is None or method.private, f"eps is for dp_ methods only, not {name}")
        need(eps is not None or not method.private, f"{name} needs eps (inf: clip only)")
        # σ(ε, δ), and the check of eps, delta and repeats (calibrate_sigma refuses bad ones)
        eps_for_sigma = math.inf if eps is None else eps  # the originals: no noise
        self.sigma = calibrate_sigma(eps=eps_for_sigma, delta=delta, repeats=repeats)
        need(clip is not None or not (method.private and by_gradient), f"{name} needs clip, C")
        fp32 = f"fp32: {FP32_TINY:.2g} to {FP32_MAX:.2g}"
        bad_clip = f"clip must be finite and > 0 ({fp32}), got {clip}"
        need(clip is None or FP32_TINY <= clip <= FP32_MAX, bad_clip)
        good_lr = lr is not None and FP32_TINY <= lr <= FP32_MAX  # (below it: 0 in fp32)
        need(good_lr or not by_gradient, f"{name} needs a finite lr > 0 ({fp32}), got {lr}")
        need(bn in ("train", "source"), "bn is 'train' or 'source'")
        need(isinstance(accumulate, int) and accumulate >= 1, "accumulate must be an int >= 1")
        need(noise_seed is None or isinstance(noise_seed, int), "noise_seed is an int or None")
        self.hp = {**method.constants, **method.filter_constants}
        unknown = sorted(set(constants) - CONSTANTS - set(self.hp))
        need(not unknown, f"unknown constant {', '.join(unknown)} for {name}")
        self.hp.update((k, v) for k, v in constants.items() if k in self.hp)
        self.eps, self.delta, self.clip, self.lr, self.repeats = eps, delta, clip, lr, repeats
        self.bn, self.accumulate, self.chunk_size = bn, accumulate, chunk_size
        self.model_params = {}
        self.releases = 1  # per image and step (DPNorm: one per private BatchNorm layer)
        bns = [m for m in model.modules() if isinstance(m, BATCH_NORM)]
        no_stats = any(m.running_mean is None for m in bns)
        need(not (no_stats and bn == "source"), "bn='source' needs BatchNorm's running statistics")
        if by_gradient:
            lower, per_sample = method.norms == "lower", clip is not None and bn == "train"
            self.model_params = adaptable_params(model, skip_top=lower, per_sample=per_sample)
        fisher, adapted = self.hp.get("fisher"), set(self.model_params)
        need(fisher is None or set(fisher) == adapted, "fisher needs one tensor per .params")
        self._check_model(model)
        self.model = model
        if method.step != "none":  # source only predicts: it claims no parameter
            self._claim()
        # every check has passed: the model is switched now (a refusal leaves it as it was)
        model.eval().requires_grad_(False)  # eval: no dropout, nothing random
        # θ: fp32 masters of bf16/fp16 parameters (bf16 rounds an update < 2^-8)
        self.params = {n: at_least_fp32(p).requires_grad_() for n, p in self.model_params.items()}
        if by_gradient and bn == "train":
            self.batch_statistics(bns)
        device = next(model.parameters()).device
        # the adapter's own streams, never rewound by reset(): the same noise twice cancels
        self.noise_seed, self.noise = noise_seed, NoiseStream(noise_seed)
        self.shuffle_gen = torch.Generator(device).manual_seed(seed)
        self.theta0 = {n: p.detach().clone() for n, p in self.params.items()}
        self.tally, self.replay = {}, None
        self.reset()

    def _check_model(self, model):
        """The last check, before the adapter claims and switches the model: the sampler
        reaches far enough for σ over an image's releases (DPNorm's own checks replace it)."""
        check_noise_reach(self.sigma, self.delta, self.releases * self.repeats)

    @staticmethod
    def batch_statistics(bns):
        """As Tent: these BatchNorm layers normalize with the test batch, no running average."""
        for m in bns:
            m.train()
            m.track_running_stats = False

    def reset(self):
        """Back to the source: θ, a fresh optimizer, the method's state; a pending window is
        dropped. The noise stream runs on: no noise is ever drawn twice."""
        self._set_theta(self.theta0)
        self.opt = None
        if self.params:
            self.opt = torch.optim.SGD(self.params.values(), lr=self.lr, momentum=0.9)
        self.state, self.window = {}, []  # EATA's m, SAR's ema, DP-SAT's Δ (DPNorm: averages)

    @torch.no_grad()
    def _set_theta(self, values, theta0=None):
        """θ ← values, written into the model (rounded for a bf16 model); θ0 ← theta0 if given
        (a checkpoint's)."""
        for n, p in self.params.items():
            p.copy_(values[n])
            self.model_params[n].copy_(p)  # p itself in an fp32 model: a no-op
            if theta0 is not None:
                self.theta0[n].copy_(theta0[n])

    # -- what the method brings: ℓ_i, its context, and the per-sample pass ------------------
    def loss(self, logits, ctx):
        """ℓ_i, the per-sample loss whose gradient is clipped."""
        return self.method.loss(logits, ctx, self.hp)

    @torch.no_grad()
    def context(self, x):
        """ℓ_i's input besides the logits (DeYO's softmax of x′), or None."""
        if self.method.context is None:
            return None
        make = partial(self.method.context, self.model, x, self.shuffle_gen, self.hp)
        return self._replayed("context", x, make)

    def _replayed(self, what, x, make):
        """make(); with self.replay, a dict, its first result for this batch x (valid while
        every call starts from θ0, as the audit's trials do). A batch is its object, as long
        as it is not written to (its _version counts writes); the dict keeps it, so that its
        id is never another batch's."""
        if self.replay is None:
            return make()
        key = (what, id(x), x._version)
        if key not in self.replay:
            self.replay[key] = x, make()
        return self.replay[key][1]

    # -- the stream: predict, then adapt -----------------------------------------------------
    def forward(self, x):
        if self.method.step == "none" or not len(x):  # source; an empty batch: no step at all
            with torch.no_grad():
                return logits_of(self.model(x))
        self._refuse_batch_statistics()
        if self.accumulate == 1:
            return self._update(x)
        # accumulate=k: predict each batch with θ, step once k have come. θ is fixed within a
        # window, so this is one step on the k batches: one noise draw, σC on the sum of k·B
        # clipped gradients (k steps would add k draws to θ, √k times the noise)
        first = self.window[0] if self.window else x
        same = (x.shape[1:], x.dtype, x.device) == (first.shape[1:], first.dtype, first.device)
        need(same, f"a batch of {tuple(x.shape[1:])} {x.dtype} in a window of other images")
        with torch.no_grad():
            logits = logits_of(self.model(x))
        self.window.append(x.detach().clone())  # a caller may write its next batch into x
        if len(self.window) == self.accumulate:
            self.flush()
        return logits

    def flush(self):
        """A step on the pending window's batches; call it when a stream ends."""
        if self.window:
            self._refuse_batch_statistics()
            x, self.window = torch.cat(self.window), []
            self._update(x)

    def _refuse_batch_statistics(self):
        """A private adapter's BatchNorm layers never normalize with the batch: a model.train()
        since the adapter was built would mix the samples of its predictions and steps."""
        if self.method.private:
            why = "a private step mixes no samples (model.train() since the adapter was built?)"
            refuse_coupled_samples(self.model, why)

    def _update(self, x):
        with torch.inference_mode(False), torch.enable_grad():  # callers under no_grad too
            x = x.clone() if x.is_inference() else x
            ctx = self.context(x)
            if self.method.step == "sam" and self.method.private:
                return self._dp_sat_step(x, ctx).detach()
            if self.method.step == "sam":
                return self._sam_step(x, ctx).detach()
            logits, g, _, self.state = self._gradient(x, ctx, self.params)
            if g is not None:  # None: the filter kept no sample, and there is no step
                self._step(g)
            return logits.detach()

    # -- the gradient: private (per sample, clipped, noised) or plain -----------------------
    def _gradient(self, x, ctx, at, keep=None, per_sample=True):
        """(logits, Δ or None, kept, the filter's new state) at the point `at` (θ itself, or
        SAM's ascent point), on the samples the filter keeps (and `keep` kept). Per sample
        (dp_, clip-only; per_sample=False: SAR's plain ascent even there): Δ = clip_and_noise(g).
        Plain: Δ = ∇ mean_kept ℓ_i, one batched backward."""
        theta = {}
        for n, t in at.items():
            theta[n] = t.detach().to(self.model_params[n].dtype).requires_grad_()
        if self.clip is None or not per_sample:
            return self._plain_gradient(theta, x, ctx, keep)
        make = partial(per_sample_grads, self.model, theta, self.loss, x, ctx)
        make = partial(make, chunk_size=self.chunk_size)
        g, logits = self._replayed("grads", x, make)
        keep, state = self._filter(logits, ctx, keep)
        if keep is not None:  # clip-only originals: the divisor is the kept count
            if not keep.any():
                return logits, None, keep, state
            g = {n: t[keep] for n, t in g.items()}
        return logits, clip_and_noise(g, self.clip, self.sigma, self.noise, self.tally), keep, state

    def _plain_gradient(self, theta, x, ctx, keep):
        """The originals' gradient, ∇ mean_kept ℓ_i, by one batched backward."""
        logits = loss_logits = logits_of(functional_call(self.model, theta, (x,)))
        keep, state = self._filter(logits, ctx, keep)
        # a non-finite sample poisons a batched backward (0·NaN = NaN): it is dropped and
        # counted, and the rest of the batch is forwarded again without it
        finite = torch.isfinite(logits).all(-1)
        averaged = finite if keep is None else keep & finite  # the rows the loss averages
        if not finite.all():
            self.tally["nonfinite"] = self.tally.get("nonfinite", 0) + (~finite).sum()
            keep = averaged  # (rows of x, as logits)
            if averaged.any():  # from here, the loss's rows are those of x[finite]
                loss_logits = logits_of(functional_call(self.model, theta, (x[finite],)))
                averaged, ctx = averaged[finite], None if ctx is None else ctx[finite]
        if keep is not None and not keep.any():
            return logits, None, keep, state
        g = torch.autograd.grad(self.loss(loss_logits, ctx)[averaged].mean(), list(theta.values()))
        return logits, {n: at_least_fp32(t) for n, t in zip(theta, g)}, keep, state

    def _filter(self, logits, ctx, keep):
        """The original's filter (none in the DP variants), and `keep`: (kept, new state)."""
        if self.method.filter is None:
            return keep, self.state
        new, state = self.method.filter(logits.detach(), ctx, self.state, self.hp)
        return (new if keep is None else keep & new), state

    # -- the steps ---------------------------------------------------------------------------
    def _step(self, g):
        """θ ← SGD-momentum(θ, Δ + the method's data-free term): post-processing of Δ."""
        penalty = self.method.penalty
        extra = None if penalty is None else penalty(self.params, self.theta0, self.hp)
        for n, p in self.params.items():
            p.grad = (g[n] if extra is None else g[n] + extra[n]).to(p.dtype)
        self.opt.step()
        self._set_theta(self.params)

    def _sam_step(self, x, ctx):
        """SAR's SAM: ascend along the plain mean gradient of the kept samples (clip-only too,
        as the paper's code does), take the gradient at θ + ρ·g/‖g‖ on those still kept
        there, step from θ; then its recovery."""
        logits, direction, keep, self.state = self._gradient(x, ctx, self.params, per_sample=False)
        if direction is None:
            return logits
        at_ascent, g, keep, _ = self._gradient(x, ctx, self._ascent(direction), keep)
        if g is None:
            return logits
        self._step(g)
        if "reset_ema" in self.hp:
            self._recover(entropy(at_ascent.detach())[keep].mean().item())
        return logits

    def _dp_sat_step(self, x, ctx):
        """DP-SAT, SAR's DP variant: the ascent direction is the previous *private* Δ (free:
        it is released; none at the first step), one private gradient per step, and the
        prediction is made at θ, not at the ascent. No recovery: a reset decided on the
        batch's entropy would be a release of its own."""
        direction = self.state.get("g_prev")
        ascent = self.params if direction is None else self._ascent(direction)
        logits, g, _, _ = self._gradient(x, ctx, ascent)
        if direction is not None:  # (those logits are at θ + ρ·Δ/‖Δ‖, not θ)
            with torch.no_grad():
                logits = logits_of(self.model(x))
        self._step(g)
        self.state = {**self.state, "g_prev": g}  # kept once the step is made
        return logits

    def _recover(self, loss):
        """SAR's model recovery: ema ← 0.9·ema + 0.1·H at the ascent point; a collapse (ema
        below reset_ema) resets θ, the optimizer and the average."""
        ema = self.state.get("ema")
        if not math.isnan(loss):
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        self.state = {**self.state, "ema": ema}
        if ema is not None and ema < self.hp["reset_ema"]:
            self.reset()

    def _ascent(self, g):
        """SAM's ascent point θ + ρ·g/‖g‖."""
        norm = torch.stack([t.pow(2).sum() for t in g.values()]).sum().sqrt().clamp(min=1e-12)
        return {n: p + self.hp["rho"] * g[n] / norm for n, p in self.params.items()}

    # -- guards: one live adapter per model, no move, its modes; copies, pickles, checkpoints
    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .half() of a built adapter: refused (a no-op one passes), as θ0, the
        fp32 masters and the shuffles' generator would stay where they were: move the model
        first."""
        p = next(self.model.parameters())
        moved = fn(p.detach())  # (a move to where it is already is no move)
        same = (moved.device, moved.dtype) == (p.device, p.dtype)
        need(same, "move or cast the model before building its DPTTA, not the adapter")
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode=True):
        """The adapter keeps its model's modes (eval; BatchNorm as `bn` says): an outer
        train() or eval() would switch dropout on, or Tent's BatchNorm off."""
        return self

    def _claim(self):
        """Two adapters on one model would share θ (and one's reset() resets the other)."""
        for n, p in self.model.named_parameters():
            # (adapter = DPTTA(model, ...) a second time builds the new one while the old lives)
            why = f"the model (its {n}) is adapted by another live DPTTA: del that one first,"
            need(id(p) not in _ADAPTED, why + " or give each adapter a copy.deepcopy(model)")
        _ADAPTED.update({id(p): self for p in self.model.parameters()})

    def _refuse_a_pending_window(self):
        """Copies, pickles and checkpoints are refused with a pending accumulate window: a copy
        would step on its images too (two releases), a pickle would write them to disk."""
        pending = f"{len(self.window)} pending accumulate batch(es) of raw test images"
        need(not self.window, f"an adapter with {pending}: flush() before copying or saving it")

    def __getstate__(self):
        """copy.deepcopy and pickle. The noise stream is left out: its key regenerates every
        draw, past ones too, and would cancel the noise of the releases. So is the audit's
        replay: it holds raw test batches and their per-sample gradients."""
        self._refuse_a_pending_window()
        return dict(super().__getstate__(), noise=None, replay=None)

    def __setstate__(self, state):
        """A copy draws its noise from a stream of its own, keyed from the OS: none is shared
        (and none is replayed: a noise_seed is not copied)."""
        super().__setstate__(state)
        if self.method.step != "none":
            self._claim()
        self.noise_seed, self.noise = None, NoiseStream()
        self.shuffle_gen.manual_seed(int.from_bytes(os.urandom(8), "little"))

    def get_extra_state(self):
        """In state_dict(): θ, θ0, the momentum, the method's state and DeYO's shuffles, so
        that a load resumes the run; all of it public (the releases, post-processed). Never
        the noise stream: the adapter that loads draws its own, so that a checkpoint can
        be shared and loaded twice without any noise drawn twice. EATA's fisher is an input,
        not a state: pass it again to the adapter that loads."""
        self._refuse_a_pending_window()
        opt = None if self.opt is None else self.opt.state_dict()
        checkpoint = dict(who=self._identity(), theta=(dict(self.params), self.theta0), opt=opt)
        return dict(checkpoint, shuffles=self.shuffle_gen.get_state(), state=self.state)

    def set_extra_state(self, state):
        need("shuffles" in state, "a checkpoint of an older dptta, with its noise: not loaded")
        mine = self._identity()
        need(state["who"] == mine, f"a checkpoint of {state['who']} cannot resume {mine}")
        self._set_theta(*state["theta"])
        if self.opt is not None:  # (a copy: the optimizer would step the checkpoint's buffers)
            self.opt.load_state_dict(copy.deepcopy(state["opt"]))
        self.state = state["state"]
        # (a generator's state is a CPU tensor, even a CUDA generator's: torch.load's
        # map_location may have moved it)
        self.shuffle_gen.set_state(state["shuffles"].cpu())

    def _identity(self):
        """What a checkpoint must match: the method, σ, C, lr and the constants (not fisher)."""
        hp = {k: v for k, v in self.hp.items() if k != "fisher"}
        return f"{self.method.name} (σ = {self.sigma!r}, C = {self.clip}, lr = {self.lr}, {hp})"


# ----------------------------------------------------------------------------
# DP-Norm (beyond the paper): BatchNorm networks, their statistics released privately
# The constants of its model of the noise (z units: standard deviations of the source's):
PRECISION = 0.1  # the noise a layer's long average aims to carry, per coordinate
MEMORY = 100  # the long average's longest memory, in batches
WINDOW = 4  # the short average's memory: a shift of the stream shows within a few batches
SHIFT = 1.5  # mean (a − b)² over SHIFT times the averages' noise variances: the stream shifted
FLOOR = 0.25  # under noise, var z >= 1/4: no layer's output scaled up by more than 2
NORM_HOPELESS = 0.5  # the average's noise above which dp_norm cannot move off the source


def release_noise(sigma, clip, batch):
    """τ², the noise variance per coordinate of a release (Σ clip(v_i, c) + N(0, σ²c²I)) / B:
    clip_and_noise draws (1 + η)σc (its lattice's η), and the lattice adds far less (γ²/12)."""
    return 0.0 if sigma == 0 else ((1 + LATTICE) * sigma * clip / batch) ** 2


def norm_gain(noise):
    """The long average's weight of a new release of noise variance τ²: 2ρ²/(τ² + ρ²), so
    that its steady noise τ²·gain/(2 − gain) is ρ² = PRECISION² (at least 1/MEMORY; 1, this
    batch alone, when there is no noise)."""
    return min(1.0, max(1 / MEMORY, 2 * PRECISION**2 / (noise + PRECISION**2)))


def running_average(average, s, noise, gain):
    """Releases s (noise variance `noise` per coordinate) averaged with weights (1 − gain)^age:
    (Σ w·s, Σ w, Σ w²·noise), from (0, 0, 0). Its value Σws/Σw, its noise Σw²noise/(Σw)²."""
    total, weight, variance = average
    return (1 - gain) * total + s, (1 - gain) * weight + 1, (1 - gain) ** 2 * variance + noise


def value_and_noise(average):
    """A running average's value Σws/Σw and its noise variance Σw²noise/(Σw)²."""
    total, weight, variance = average
    return total / weight, variance / weight**2


def averaged(averages, s, noise):
    """(long, short) running averages with a new release s. When the mean squared gap between
    them exceeds SHIFT times the sum of their noise variances, the stream has shifted
    (a new corruption): the long one restarts from the short one."""
    empty = (0 * s, 0.0, 0.0)
    long, short = (empty, empty) if averages is None else averages
    gain = norm_gain(noise)
    long, short = (
        running_average(long, s, noise, gain),
        running_average(short, s, noise, max(gain, 1 / WINDOW)),
    )
    (a, noise_a), (b, noise_b) = value_and_noise(long), value_and_noise(short)
    if noise_a + noise_b > 0 and (a - b).pow(2).mean() > SHIFT * (noise_a + noise_b):
        long = short
    return long, short


def estimated(averages, channels):
    """(a, var z) of a layer from its long average of (mean z, mean z² − 1), noise n each.

    The mean a and the variance v − 1 = (mean z² − 1) − a² are estimated without bias
    (E[â²] = a² + n, so v̂ − 1 = b̂ − â² + n), then each is shrunk toward the source (0)
    by its signal-to-noise ratio, James-Stein: x·max(0, 1 − noise/mean(x²)), over the
    layer's channels; v̂'s noise is about n·(1 + 4·mean(â²)) (the square of a noisy â)."""
    value, noise = value_and_noise(averages[0])
    a, b = value[:channels], value[channels:]
    if noise == 0:
        return a, 1 + b - a**2
    v = b - a**2 + noise
    v_noise = noise * (1 + 4 * a.pow(2).mean().item())
    a, v = shrunk(a, noise), shrunk(v, v_noise)
    return a, (1 + v).clamp(min=FLOOR)


def shrunk(x, noise):
    """x·max(0, 1 − noise/mean(x²)): the part of x its noise cannot explain."""
    return x * max(0.0, 1 - noise / max(x.pow(2).mean().item(), 1e-30))


def bn_moments(x, mean, var, eps):
    """DP-Norm's per-sample statistic of a BatchNorm input x [B, channels, ...]: v_i = (mean z,
    mean z² − 1) over the image's positions, z = (x − μ_src)/√(var_src + eps), [B, 2·channels].
    It is 0 at the source's statistics, so a clip shrinks it toward the source."""
    z = at_least_fp32(x.reshape(*x.shape[:2], -1))  # [B, channels, H·W] (BatchNorm1d: H·W = 1)
    z = (z - mean[:, None]) / (var[:, None] + eps).sqrt()
    return torch.cat([z.mean(-1), z.pow(2).mean(-1) - 1], 1)


class DPNorm(DPTTA):
    """norm and dp_norm, for BatchNorm networks: no gradient, the statistics re-estimated.

    On a BatchNorm network most of TTA's gain comes from re-estimating the normalization
    statistics on the test batches ("norm", Schneider et al. 2020: train-mode BatchNorm),
    and those statistics are what leaks: each is an average over the batch's images.
    dp_norm releases them privately. Before each of the first bn_layers BatchNorm layers
    (default all: L layers) runs, the batch's moments are released:

        s = (Σ_i clip(v_i, c) + N(0, σ_l²c²I)) / B,  v_i = bn_moments(x_i),
        c = moment_clip(channels) = bn_scale·√(2·channels)

    (v_i has two moments per channel: its norm grows as √(2·channels), and so does c.)
    Replacing one image moves the sum by at most 2c, so each release is (2/σ_l)-GDP; an
    image is in one batch, and the L releases of a forward compose to 2√L/σ_l = 2/σ, so
    σ_l = √L·σ(ε, δ). The release's noise is known exactly, τ = (1 + η)σ_l·c/B per coordinate,
    and everything after it is post-processing: the releases are averaged (running_average,
    a long and a short memory, restarted when the stream shifts), each layer's mean and
    variance are estimated without bias and shrunk toward the source by their
    signal-to-noise ratio (estimated), and the layer normalizes with μ = μ_src + σ_src·a and
    σ² = σ_src²·v. Where the noise exceeds what the average can carry, a layer stays at the
    source's statistics: dp_norm then stays near the source's accuracy instead of losing
    it (README: 0.7 points below it at worst in its table; 2.7 at ε = 0.5). BatchNorm
    layers after the first bn_layers keep their source statistics; the model must run each
    BatchNorm module once per forward."""

    def __init__(self, model, method="dp_norm", **kwargs):
        super().__init__(model, method, **kwargs)  # its checks first: _check_model
        bns = [(n, m) for n, m in model.named_modules() if isinstance(m, BATCH_NORM)]
        chosen = bns[: self.hp["bn_layers"]]
        self.checked = not self.method.private
        if not self.method.private:
            self.batch_statistics([m for _, m in chosen])
            return
        self.bn_src = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in chosen}
        self.releases = len(self.bn_src)
        self.sigma *= math.sqrt(self.releases)  # σ_l = √L·σ: L releases per image
        self.reset()

    def _check_model(self, model):
        """DPNorm's checks, before DPTTA claims and switches the model: BatchNorm layers with
        running statistics, a count of them, and the sampler's reach at σ_l = √L·σ."""
        name, private = self.method.name, self.method.private
        bns = [(n, m) for n, m in model.named_modules() if isinstance(m, BATCH_NORM)]
        need(bns and self.bn == "train", f"{name} needs a model with BatchNorm, not frozen")
        need(self.accumulate == 1 or private, "norm has nothing to accumulate")
        k, layers = self.hp["bn_layers"], f"from 1 to the model's {len(bns)} BatchNorm layers"
        need(
            k is None or isinstance(k, int) and 1 <= k <= len(bns),
            f"bn_layers must be a count {layers}",
        )
        if not private:
            return
        for layer, m in bns:  # (one past bn_layers without them would mix the batch, noiseless)
            missing = f"{name}: BatchNorm {layer} has no running statistics"
            need(m.running_mean is not None, missing)
        L = len(bns[:k])
        check_noise_reach(self.sigma * math.sqrt(L), self.delta, L * self.repeats)

    def reset(self):
        """DPTTA's reset, and the source's statistics back in every private layer."""
        super().reset()
        self._normalize_all()

    def set_extra_state(self, state):
        """DPTTA's load, and each private layer's statistics from the averages it loaded (the
        layers' buffers are the model's, not the adapter's)."""
        super().set_extra_state(state)
        self._normalize_all()

    def _normalize_all(self):
        for name in self.bn_src:
            self._normalize(name)

    def _normalize(self, name):
        """Private layer `name` normalizes with what its averages estimate: μ = μ_src + σ_src·a,
        σ² = σ_src²·var z; before any release, with the source's statistics."""
        mean, var = self.bn_src[name]
        bn = self.model.get_submodule(name)
        if name not in self.state:
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
            return
        a, ratio = estimated(self.state[name], len(mean))
        bn.running_mean.copy_(mean + (var + bn.eps).sqrt() * a)
        # (var + eps)·var z: train mode's batch variance, to which BatchNorm adds eps again, as
        # train mode does (so at the source, var z = 1, it reads σ_src² + 2·eps)
        bn.running_var.copy_((var + bn.eps) * ratio)

    def _update(self, x):
        if not self.checked:  # before the first release: one release per layer and forward
            self.check_releases(torch.zeros_like(x[:1]))
        before = dict(self.state)  # each layer's averages are replaced, never changed in place
        try:
            with torch.no_grad(), contextlib.ExitStack() as hooks:
                for name in self.bn_src:  # a hook's handle removes it on exit
                    hook = partial(self._release_statistics, name)
                    module = self.model.get_submodule(name)
                    hooks.enter_context(module.register_forward_pre_hook(hook))
                return logits_of(self.model(x))
        except BaseException:  # a forward that fails keeps no layer's release (a retry would
            self.state = before  # release those layers' statistics of its batch twice)
            self._normalize_all()
            raise

    def check_releases(self, x):
        """Each run of a BatchNorm layer is a release, accounted once per layer and image: a
        module run twice in a forward (shared, or a block applied twice) would release twice
        (L = 1 with 2 releases is ε = 7.46 at a claimed 5), and a layer fed N rows per image
        (LeViT's BatchNorm1d on the tokens) would move its sum by 2c·N, not 2c. A forward of
        x, data-free (zeros of the input's shape), counts the calls and the rows; a layer
        called more than once, or fed other than one row per image, is refused."""
        calls = dict.fromkeys(self.bn_src, 0)

        def count(name, module, args):
            calls[name] += 1
            rows = f"{len(args[0])} rows for {len(x)} image(s)"
            need(len(args[0]) == len(x), f"BatchNorm {name} gets {rows}: one per image is private")

        with torch.no_grad(), contextlib.ExitStack() as hooks:
            for name in self.bn_src:
                module = self.model.get_submodule(name)
                hooks.enter_context(module.register_forward_pre_hook(partial(count, name)))
            self.model(x)
        twice = [f"{n} ({k}x)" for n, k in calls.items() if k > 1]
        need(
            not twice,
            f"BatchNorm {', '.join(twice)} runs more than once per forward: each run "
            "is a release dp_norm does not account; give each use its own module",
        )
        self.checked = True

    def moment_clip(self, channels):
        """c = bn_scale·√(2·channels), the clip of a layer's v_i: an image whose channels sit
        one source standard deviation off has ‖v_i‖ ≈ √(2·channels)."""
        return self.hp["bn_scale"] * math.sqrt(2 * channels)

    def _release_statistics(self, name, bn, args):
        """Before BatchNorm layer `name` runs: release its batch's moments, average, estimate."""
        mean, var = self.bn_src[name]
        v = bn_moments(args[0], mean, var, bn.eps)
        c = self.moment_clip(len(mean))
        s = clip_and_noise({"v": v}, c, self.sigma, self.noise, self.tally)["v"]
        tau2 = release_noise(self.sigma, c, len(v))
        self.state[name] = averaged(self.state.get(name), s, tau2)
        self._normalize(name)


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
# the clip-only originals (filters kept, per-sample clip, no noise): (C, lr)
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
    """(C, lr, where they come from) in the paper's tables; an original with a clip, and a DP
    variant at ε = inf (no noise), take the clip-only row. clip: the run's C, read only as
    whether there is one (that row's lr was tuned with that row's C: with another C, pass
    --lr too). COME alone has no row (Tent's is used); an ε the paper did not tune takes the
    nearest tuned ε on a log scale; a method of the user's own has none."""
    private, base = METHODS[method].private, method.removeprefix("dp_")
    table, note = base, ""
    if base == "come":  # the paper has no row for COME alone: Tent's, a plain step with no filter
        table, note = "tent", "; no entry for come alone, tent's used"
    if METHODS[method].step not in ("plain", "sam"):
        return None, None, "no gradient step"
    if table not in PAPER_LR["continual"]:
        return None, None, f"no paper values for {method}"
    if not private and clip is None:
        return None, PAPER_LR[setting][table], f"paper, non-private {table}, {setting}{note}"
    if not private or math.isinf(eps):
        C, lr = PAPER_CLIP_ONLY[setting][table]
        if private:  # the paper tuned no DP variant at ε = inf (no filter, no noise)
            note += f"; for dp_{table} at ε=inf, unfiltered"
        return C, lr, f"paper, clip-only {table}, {setting}{note}"
    near = min(TUNED_EPS, key=lambda e: abs(math.log(e / eps)))
    if near != eps:
        note += f"; ε={eps:g} not tuned, nearest tuned ε={near} (log scale) used"
    C, lr = PAPER_DP[setting][table][near]
    return C, lr, f"paper, dp_{table} ε={near}, {setting}{note}"


# ============================================================================
# Part II: ImageNet-C from the command line (data, checks, records, main)
import argparse
import fcntl
import functools
import io
import json
import signal
import stat
import sys
import tempfile
import time
import uuid

import timm
from PIL import Image
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import has_file_allowed_extension

# ----------------------------------------------------------------------------
# Data: ImageNet-C and ImageNet-R folders, labelled by WordNet id
CORRUPTIONS = tuple(  # ImageNet-C's 15, in the customary order
    "gaussian_noise shot_noise impulse_noise defocus_blur glass_blur motion_blur zoom_blur snow "
    "frost fog brightness contrast elastic_transform pixelate jpeg_compression".split()
)
HELD_OUT = ("speckle_noise", "gaussian_blur", "spatter", "saturate")  # to tune on
LAYOUT = (
    "expected ROOT/<corruption>/<severity>/<wnid>/*.JPEG (ImageNet-R: ROOT/<wnid>/*.jpg); "
    "ImageNet-C: https://zenodo.org/record/2235448"
)


def reached_once(seen, path, node):
    """μ = 2/σ for a stream assumes each image once: a file or folder reached twice (a
    symlink, a link loop, a hard link: the same device and inode) is refused, naming both."""
    first = seen.setdefault(node, path)
    need(first == path, f"{path} is {first} again (a link?): an image is in a stream once")


class UnreadableFile(OSError):
    """A file the system could not read (permissions, a failing disk), unlike a corrupt
    image: it stops the run, which --resume takes up once the file reads, with the size and
    modification time it was listed with (data_fingerprint: a copy put back needs its time
    restored), rather than turn a passing failure into a gray image no rerun would see again."""


def no_link(name, flags):
    """An opener for open(): a symbolic link is not followed (OSError)."""
    return os.open(name, flags | os.O_NOFOLLOW)


def read_file(path):
    """The file's bytes; the system's failure to read them is an UnreadableFile, named. It is
    opened without blocking: a FIFO put in its place since the listing would stop the run."""
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
            data = f.read() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
    except OSError as e:
        raise UnreadableFile(f"cannot read {path}: {e.strerror}") from e
    if data is None:
        raise UnreadableFile(f"cannot read {path}: no longer a regular file")
    return data


def load_rgb(path):
    """An RGB image from a path or a file's bytes (io.BytesIO). PIL's convert clips a 16-bit
    greyscale PNG (I;16) at 255, 99.7% white: it is scaled to 8 bits instead; a 32-bit integer
    or float image is refused (unreadable)."""
    with Image.open(path) as img:
        if img.mode.startswith("I;16"):
            pixels = np.asarray(img, dtype=np.float64) / 257  # 65535 -> 255
            return Image.fromarray(pixels.round().astype(np.uint8)).convert("RGB")
        need(img.mode not in ("I", "F"), f"a {img.mode}-mode (32-bit) image: convert it to 8 bits")
        return img.convert("RGB")


class WnidFolder(ImageFolder):
    """An ImageFolder whose targets are ImageNet-1k indices by WordNet id (any subset of the
    1,000 classes), never folder enumeration. An unreadable image gives (None, path).

    Hidden files and folders (a leading ".": macOS' ._ twins, .DS_Store, .ipynb_checkpoints)
    are skipped, and so is a file that is not regular (a FIFO named *.JPEG would hang the
    loader); a folder inside a class folder is refused (its images would take the class's
    label). nodes {(device, inode): path} and files {path: os.stat} keep what was listed."""

    def __init__(self, root, transform=None):
        super().__init__(root, transform)  # raises: no class folder, an empty one
        index = {w: i for i, w in enumerate(timm.data.ImageNetInfo().label_names())}
        for c in self.classes:
            need(c in index, f"{c} is not an ImageNet-1k WordNet id")
        self.imagenet_index = [index[c] for c in self.classes]

    def find_classes(self, directory):
        names = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        classes = [c for c in names if not c.startswith(".")]
        if not classes:
            raise FileNotFoundError(f"no class folder in {directory}")
        return classes, {c: i for i, c in enumerate(classes)}

    def make_dataset(self, directory, class_to_idx, extensions=None, *args, **kwargs):
        self.nodes, self.files, samples = {}, {}, []
        st = os.stat(directory)
        reached_once(self.nodes, directory, (st.st_dev, st.st_ino))
        for c, target in class_to_idx.items():
            folder = os.path.join(directory, c)
            st = os.stat(folder)
            reached_once(self.nodes, folder, (st.st_dev, st.st_ino))
            found = []
            for name in sorted(os.listdir(folder)):
                if name.startswith("."):  # hidden: macOS' ._ twins, .DS_Store, checkpoints
                    continue
                path = os.path.join(folder, name)
                st = os.stat(path)
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    continue  # a FIFO, a socket, a device
                reached_once(self.nodes, path, (st.st_dev, st.st_ino))
                need(not stat.S_ISDIR(st.st_mode), f"{path} is a folder inside a class folder")
                if has_file_allowed_extension(path, extensions):
                    # (found now, not hours into a run: a read that fails stops the run)
                    need(os.access(path, os.R_OK), f"cannot read {path}: no permission")
                    found.append(path)
                    self.files[path] = st
            if not found:
                raise FileNotFoundError(f"no image in class folder {folder}")
            samples += [(path, target) for path in found]
        return samples

    def __getitem__(self, i):
        """(image, ImageNet index), or (None, path) for an image that cannot be decoded. The
        file is read first, and a read that fails stops the run (UnreadableFile); whatever
        goes wrong decoding its bytes is the file's own, and skips it."""
        path, c = self.samples[i]
        data = read_file(path)
        try:
            return self.transform(load_rgb(io.BytesIO(data))), self.imagenet_index[c]
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            return None, path  # truncated, corrupt, not an image, a decompression bomb


def collate_skipping(batch):
    """(x, y, unreadable paths). An unreadable image becomes a gray placeholder with label
    −1: never scored, but in the batch, so that B, the divisor, never depends on a file (a
    batch with none to copy the shape of: x = None, and the stream fills it with gray)."""
    bad = [path for x, path in batch if x is None]
    good = [b for b in batch if b[0] is not None]
    if not good:
        return None, None, bad
    blank = (torch.zeros_like(good[0][0]), -1)
    return (*default_collate([blank if b[0] is None else b for b in batch]), bad)


class Mixed(torch.utils.data.ConcatDataset):
    """--setting mixed (SAR's mixed shifts): every corruption in one stream, each image
    labelled y + TAG·c with its corruption c, so that each is scored apart (open_streams has
    refused a file in two corruptions' folders)."""

    TAG = 1000

    def __init__(self, streams):
        super().__init__(list(streams.values()))
        self.targets = [ds.imagenet_index[t] for ds in self.datasets for t in ds.targets]

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        c = int(np.searchsorted(self.cumulative_sizes, i, "right"))
        return (x, y) if x is None else (x, y + self.TAG * c)


def image_stream(
    dataset, batch_size, *, seed, workers, limit=None, order="random", pin_memory=False, rerun=0
):
    """Batches of a seeded shuffle's first `limit` images (a mixed stream's: per corruption),
    the same images in every round, in an order: random (round r, rerun=r: reshuffled);
    class (sorted by label, SAR's online label shift); or dirichlet:ALPHA (each class spread
    over as many time slots as classes by Dir(ALPHA) shares, as RoTTA draws it)."""
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    if limit is not None:
        # the corruption of each image: a mixed stream's parts, else one part
        ends = getattr(dataset, "cumulative_sizes", [len(dataset)])
        group = np.searchsorted(ends, perm.numpy(), "right")
        rank = np.zeros(len(perm), dtype=int)  # each image's place among its group's, in order
        for g in np.unique(group):
            rank[group == g] = np.arange(np.count_nonzero(group == g))
        perm = perm[torch.as_tensor(rank < limit)]
    if rerun:  # a later round: its own order of the same images
        reorder = torch.Generator().manual_seed(seed + rerun)
        perm = perm[torch.randperm(len(perm), generator=reorder)]
    labels = np.asarray(dataset.targets)[perm.numpy()]
    if order == "class":
        perm = perm[np.argsort(labels, kind="stable")]
    if order.startswith("dirichlet:"):
        rng, classes = np.random.default_rng(seed + rerun), np.unique(labels)
        slots = [[] for _ in classes]
        for c in classes:  # class c's images cut into the slots by Dir(α) shares
            share = rng.dirichlet([float(order[10:])] * len(classes))
            cuts = (np.cumsum(share) * (labels == c).sum()).astype(int)[:-1]
            for slot, part in zip(slots, np.split(perm.numpy()[labels == c], cuts)):
                slot.extend(part)
        perm = torch.as_tensor([i for slot in slots for i in rng.permutation(slot)], dtype=int)
    subset = Subset(dataset, perm.tolist())
    return DataLoader(
        subset,
        batch_size,
        num_workers=workers,
        collate_fn=collate_skipping,
        pin_memory=pin_memory,
        worker_init_fn=leave_stops_to_the_run,
    )


@contextlib.contextmanager
def batches_of(loader):
    """The loader's batches, its workers stopped as the loop ends (an error's too). They ignore
    SIGTERM (leave_stops_to_the_run), and workers left to Python's exit (as they were after an
    error raised in one) are sent that SIGTERM and waited for: the run hung."""
    batches = iter(loader)
    try:
        yield batches
    finally:
        if hasattr(batches, "_shutdown_workers"):  # (torch's; no workers, no method)
            batches._shutdown_workers()


def leave_stops_to_the_run(worker_id):
    """A loader worker ignores SIGTERM and SIGHUP (as it ignores SIGINT): sent to the whole
    process group (scancel, timeout, a closed terminal), they would kill it mid-batch, and the
    run would end in a traceback instead of stopping. The run stops, and its workers with it."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)


def make_synthetic_tree(root, corruptions, severity, n, size=64, seed=0):
    """An ImageNet-C-shaped tree of random JPEGs, n per corruption over 10 wnids (smoke runs)."""
    wnids, rng = timm.data.ImageNetInfo().label_names()[:10], np.random.default_rng(seed)
    for c in corruptions:
        for i in range(n):
            folder = os.path.join(root, c, str(severity), wnids[i % len(wnids)])
            os.makedirs(folder, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            path = os.path.join(folder, f"{i:06d}.JPEG")
            Image.fromarray(pixels).save(path, quality=90)
            os.utime(path, ns=(0, 0))  # the same tree each time, to its files' times (resume)
    return root


def data_fingerprint(folder):
    """A digest of a WnidFolder's files (path under its root, bytes, modification time): a
    resumed run goes on over the tree its records so far came from (and the same Fisher
    images), or its records would mix two trees under one key."""
    files = sorted(
        (os.path.relpath(path, folder.root), st.st_size, st.st_mtime_ns)
        for path, st in folder.files.items()
    )
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def check_public(fisher_set, streams, used):
    """EATA's penalty is data-free only if its images are public: a Fisher image that is a
    stream's file (its device and inode: the same folder, a link) or a byte copy of one (the
    `used` images, compared with the stream's files of the same size) is refused."""
    nodes, by_size = {}, {}
    for ds in streams.values():
        nodes.update(ds.nodes)
        for path, st in ds.files.items():
            by_size.setdefault(st.st_size, []).append(path)
    public = "EATA's Fisher images must be public, never the test stream"
    for node, path in fisher_set.nodes.items():
        if node in nodes:
            fail(f"--fisher-data: {path} is the stream's {nodes[node]}; {public}")
    for i in used:
        path = fisher_set.samples[i][0]
        same_size = by_size.get(fisher_set.files[path].st_size, [])
        digest = file_digest(path) if same_size else None
        for original in (p for p in same_size if file_digest(p) == digest):  # the first found
            fail(f"--fisher-data: {path} is a copy of the stream's {original}; {public}")


def file_digest(path):
    """SHA-256 of a file's bytes; one that cannot be read is one line before the first image."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).digest()
    except OSError as e:
        fail(f"--fisher-data: cannot compare {path} with the stream's files: {one_line(e)}")


# The constants --hp NAME=VALUE may set: (type, low, high), an open interval
# a margin is a fraction of ln K (above 1 every sample passes its filter); EATA's and DeYO's
# weight exp(margin·ln K − H) overflows fp32 beyond margin·ln K = 88, which 8 keeps for K < 60,000
HP_TYPES = dict(
    e_margin=(float, 0, 8),
    d_margin=(float, 0, math.inf),
    rho=(float, 0, math.inf),
    reset_ema=(float, -math.inf, math.inf),
    deyo_margin=(float, 0, 8),
    plpd_threshold=(float, -1, 1),
    patch_grid=(int, 0, math.inf),
    num_classes=(int, 1, math.inf),
    fisher_lambda=(float, 0, math.inf),
    fisher_size=(int, 0, math.inf),
    bn_layers=(int, 0, math.inf),
    bn_scale=(float, 1e-30, 1e30),  # its clip c = bn_scale·√(2·channels): within fp32
)


def constants_used(method, fisher=False):
    """The --hp names that change a run of `method`: its record's constants (the filter's
    where the filter runs), EATA's Fisher weight and size only with Fisher data."""
    record = METHODS[method]
    names = {*record.constants, *record.filter_constants} - {"fisher"}
    if "fisher_lambda" in names:
        if fisher:
            names.add("fisher_size")
        else:
            names.remove("fisher_lambda")
    return names


# ----------------------------------------------------------------------------
# The command line: checks, one line on stderr and exit 2 before the first image
DEFAULT_MODEL = "vit_base_patch16_224.augreg2_in21k_ft_in1k"
STOP = []  # the signals received; the stream loop checks it
PROGRESS_SECONDS = 60  # a progress line at least this often on long work
NEW_RUN = "rerun without --resume for a new run (both runs' releases count)"


def fail(message, code=2):
    """One line on stderr; exit 2 (bad input), 3 (the stream stopped it: diverged, or no image
    readable) or 4 (a file not written or read)."""
    print(f"dptta: error: {message}", file=sys.stderr)
    sys.exit(code)


def warn(message):
    print(f"dptta: warning: {message}", file=sys.stderr)


def require(ok, message):
    if not ok:
        fail(message)


def one_line(e, limit=300):
    """An exception's message on one line, cut at `limit` characters: a state_dict that does
    not fit lists every key (12 KB for ViT-B/16), and one line should read at a glance."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text if text else type(e).__name__


def or_fail(make, *args, **kwargs):
    """make(...), with the library's ValueError as one line and exit 2."""
    try:
        return make(*args, **kwargs)
    except ValueError as e:
        fail(str(e))


def parser_error(message):
    """argparse's errors, as dptta's: "argument --lr: must be ..." -> "--lr must be ..."."""
    fail(re.sub(r"^argument (--[\w-]+): ", r"\1 ", message))


def number(kind, low, high=math.inf, strict=False):
    """An argparse type: a `kind` in [low, high], or (low, high) if strict; NaN is out. A
    float with no upper bound is still an fp32 (C and lr meet θ in fp32: 1e39 overflows)."""
    shown = f"in {low}..{high}"
    if high == math.inf:
        shown = f"> {low}" if strict else f">= {low}"
        if kind is float:
            shown, high = f"finite in fp32 and {shown}", FP32_MAX
    elif strict:
        shown = f"in ({low}, {high})"

    def parse(text):
        value = kind(text)
        inside = low < value < high if strict else low <= value <= high
        if not inside:
            raise argparse.ArgumentTypeError(f"must be {shown}, got {text}")
        return value

    return parse


def eps_value(text):
    """ε > 0, at most EPS_MAX, or inf; a number too large for a float (1e400) is refused."""
    value = float(text)
    if math.isinf(value) and text.strip().lower().lstrip("+") not in ("inf", "infinity"):
        raise argparse.ArgumentTypeError(f"{text} overflows a float: give a finite ε or inf")
    if not (0 < value <= EPS_MAX or value == math.inf):
        raise argparse.ArgumentTypeError(f"must be > 0 and <= {EPS_MAX:g}, or inf, got {text}")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.partition(".")[0])
    ap.error = parser_error  # a bad flag: one line, exit 2 too
    positive = number(float, 0, strict=True)
    add = ap.add_argument_group("method and privacy").add_argument
    add("--method", default="dp_tent", choices=list(METHODS), help="default dp_tent")
    add("--eps", type=eps_value, help="ε of a dp_ method; inf: clip only (default 5)")
    add("--delta", type=number(float, 0, 1, strict=True), help="δ of a dp_ method (default 1e-6)")
    add("--privacy-unit", default="image", choices=("image", "photo"), help="photo: σ·√streams")
    add("--clip", type=positive, help="per-sample clip C (default: paper's); originals: clip-only")
    add("--lr", type=positive, help="SGD learning rate (default: paper's)")
    constants = f"a method constant: {', '.join(HP_TYPES)}"
    add("--hp", action="append", default=[], metavar="NAME=VALUE", help=constants)
    add("--noise-seed", type=number(int, 0, 2**63 - 1), help="replay the noise: NOT private")
    add = ap.add_argument_group("data").add_argument
    add("--data", default=os.environ.get("IMAGENET_C"), help="root (default $IMAGENET_C)")
    add("--dataset", default="imagenet_c", choices=("imagenet_c", "imagenet_r"))
    add("--severity", type=number(int, 1, 5), help="ImageNet-C's, 1-5 (default 5)")
    add("--corruptions", default=",".join(CORRUPTIONS), help="comma-separated, in order")
    add("--fisher-data", help="EATA's public clean images (<wnid>/ folders)")
    add("--limit", type=number(int, 1), help="images per corruption")
    add("--workers", type=number(int, 0), default=min(8, os.cpu_count() if os.cpu_count() else 1))
    add("--synthetic", type=number(int, 1), metavar="N", help="smoke run: N random images each")
    add = ap.add_argument_group("model").add_argument
    add("--model", help=f"timm name (default {DEFAULT_MODEL})")
    add("--checkpoint", help="local weights for --model")
    add("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda if any")
    add("--amp", default="bf16", choices=("bf16", "off"), help="bf16 autocast on CUDA")
    add("--bn", choices=("train", "source"), help="BatchNorm: test batch or source statistics")
    add = ap.add_argument_group("run").add_argument
    settings = "episodic: reset before each corruption; mixed: all in one stream"
    add("--setting", default="continual", choices=("continual", "episodic", "mixed"), help=settings)
    add("--order", default="random", help="random, class or dirichlet:ALPHA")
    add("--repeat", type=number(int, 1), default=1, help="stream the corruptions N times")
    add("--accumulate", type=number(int, 1), default=1, help="a step per K batches")
    add("--batch-size", type=number(int, 1), help="default 64 (--benchmark on CPU: 32)")
    add("--seed", type=number(int, 0, 2**63 - 1), default=0, help="data order, patch shuffles")
    add("--out", help="JSON lines, appended (default results*.jsonl)")
    add("--resume", action="store_true", help="skip a run --out holds; finish a killed one")
    add("--log-every", type=number(int, 1), default=100, help="a progress line per N batches")
    add = ap.add_argument_group("tools").add_argument
    add("--summarize", metavar="JSONL", help="the paper-style tables of a file")
    add("--per-corruption", action="store_true", help="--summarize: per corruption too")
    add("--error", action="store_true", help="--summarize: error %%, not top-1")
    add("--benchmark", action="store_true", help="time a step of every method")
    add("--rounds", type=number(int, 1), default=5, help="--benchmark: timed rounds (default 5)")
    add("--audit", action="store_true", help="an empirical ε lower bound")
    trials = number(int, 100)
    add("--trials", type=trials, default=20000, help="--audit: white-box trials (default 20000)")
    add("--e2e-trials", type=trials, default=5000, help="--audit: end-to-end trials (default 5000)")
    args = ap.parse_args(argv)
    for action in ap._actions:  # parsed again with no defaults: the flags the command gave
        action.default = argparse.SUPPRESS
    args.given = sorted(vars(ap.parse_args(argv)))
    return args


# the flags only one tool reads (their defaults are argparse's), and that tool: refused in a run
TOOL_FLAGS = dict(
    rounds="benchmark",
    trials="audit",
    e2e_trials="audit",
    error="summarize",
    per_corruption="summarize",
)


# the flags each tool reads, besides the machine's (--device, --workers); any other flag given
# to a tool is refused, not ignored
MODE_FLAGS = dict(
    summarize="summarize per_corruption error",
    benchmark="benchmark model batch_size accumulate amp bn seed out rounds",
    audit="audit method eps delta clip lr seed trials e2e_trials out",
)


def check_common(args, mode=None):
    """What every mode reads: no other mode's flag, the device and dtype (decided once)."""
    given = set(args.given)
    if mode is None:
        for flag in sorted(given & set(TOOL_FLAGS)):
            fail(f"--{flag.replace('_', '-')} is for --{TOOL_FLAGS[flag]} only")
    else:  # (another tool's flag among them)
        for flag in sorted(given - set(MODE_FLAGS[mode].split()) - {"device", "workers"}):
            fail(f"--{flag.replace('_', '-')} does not apply to --{mode}")
    if args.model is not None:
        check_model(args.model)
    require(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = "bf16" if args.amp == "bf16" and args.device == "cuda" else "fp32"


ORDERS = "random, class or dirichlet:ALPHA (ALPHA > 0)"


def check_args(args):
    """Every flag of a run checked and its default filled in: one line and exit 2 if wrong."""
    check_common(args)
    record = METHODS[args.method]
    private, name, gradient = record.private, args.method, record.step in ("plain", "sam")
    hint = "" if gradient or record.step == "none" else f" (try dp_{name})"
    if not private:
        require(args.eps is None, f"--eps applies to dp_ methods only; {name} is not private{hint}")
    elif args.eps is None:
        args.eps = 5.0
    noisy = private and math.isfinite(args.eps)  # a flag that changes nothing: refused
    given = {"--delta": args.delta is not None, "--noise-seed": args.noise_seed is not None}
    given["--privacy-unit photo"] = args.privacy_unit == "photo"
    for flag, used in given.items():
        require(not used or noisy, f"{flag} applies to a dp_ method with a finite --eps")
    if noisy and args.delta is None:
        args.delta = 1e-6
    require(
        gradient or (args.clip, args.lr, args.bn) == (None, None, None),
        f"{name} takes no gradient step: --clip, --lr and --bn do not apply",
    )
    if args.fisher_data and "fisher" not in record.constants:  # a grid's EXTRA gives every cell
        print(f"note: --fisher-data is for eata and dp_eata; {name} ignores it")
        args.fisher_data = None
    kind, _, alpha = args.order.partition(":")
    dirichlet = kind == "dirichlet" and is_positive(alpha)
    require(args.order in ("random", "class") or dirichlet, f"--order {args.order!r}: {ORDERS}")
    if not (gradient or private):  # no state to keep (dp_norm keeps its average: both apply)
        for flag, value in (("repeat", args.repeat), ("accumulate", args.accumulate)):
            require(value == 1, f"--{flag}: {name} keeps no state, so it changes nothing")
    require(
        args.repeat == 1 or args.setting != "episodic",
        "--repeat is for continual or mixed streams (episodic resets)",
    )
    require(args.severity is None or args.dataset == "imagenet_c", "--severity: ImageNet-C only")
    args.severity = 5 if args.severity is None else args.severity
    args.hp = parse_hp(args.hp, name)
    for hp in sorted(set(args.hp) - constants_used(name, bool(args.fisher_data))):
        fail(f"--hp {hp} does not change a {name} run (see constants_used)")
    if args.batch_size is None:
        args.batch_size = 64
    if args.model is None:
        args.model = DEFAULT_MODEL
    args.corruptions = [c for c in args.corruptions.split(",") if c]
    require(args.corruptions, "--corruptions is empty")
    known = CORRUPTIONS + HELD_OUT
    for c in args.corruptions:
        require(c in known, f"unknown corruption {c!r}; one of {', '.join(known)}")
    require(len(set(args.corruptions)) == len(args.corruptions), "--corruptions repeats one")
    if args.dataset == "imagenet_r":
        require(not args.synthetic, "--synthetic makes ImageNet-C trees, not ImageNet-R")
        require(args.corruptions == list(CORRUPTIONS), "--corruptions: ImageNet-R has none")
        args.corruptions = ["imagenet_r"]
    if args.synthetic:
        require("data" not in args.given, "--synthetic makes its own tree: --data does not apply")
        if args.corruptions == list(CORRUPTIONS):  # a short smoke run
            args.corruptions = args.corruptions[:3]
    else:
        require(args.data, f"no data root: pass --data or set $IMAGENET_C; {LAYOUT}")
        require(os.path.isdir(args.data), f"--data {args.data} is not a folder; {LAYOUT}")
    for flag, fits, kind in (
        ("checkpoint", os.path.isfile, "a file"),
        ("fisher_data", os.path.isdir, "a folder of <wnid>/ folders"),
    ):
        path, shown = getattr(args, flag), "--" + flag.replace("_", "-")
        require(path is None or os.path.exists(path), f"{shown} {path} does not exist")
        require(path is None or fits(path), f"{shown} {path} is not {kind}")
    check_out(args, "results-smoke.jsonl" if args.synthetic else "results.jsonl")
    return args


def is_positive(text):
    """Whether text is a finite number > 0."""
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False


def parse_hp(items, method):
    """["e_margin=0.5", ...] -> {"e_margin": 0.5}: known names, finite values in range (a
    constant of a method of one's own: any finite float)."""
    hp, known = {}, {*HP_TYPES, *METHODS[method].constants, *METHODS[method].filter_constants}
    for item in items:
        name, _, text = item.partition("=")
        require(name in known, f"--hp {item}: unknown constant; {', '.join(HP_TYPES)}")
        require(name not in hp, f"--hp {name} is given twice: one value each")
        kind, low, high = HP_TYPES.get(name, (float, -math.inf, math.inf))
        try:
            hp[name] = kind(text)
        except ValueError:
            fail(f"--hp {item}: {text!r} is not a {kind.__name__}")
        # (an int beyond a float's range is refused before isfinite, which would overflow on it)
        finite = abs(hp[name]) <= sys.float_info.max and math.isfinite(hp[name])
        require(finite, f"--hp {item}: must be finite")
        require(low < hp[name] < high, f"--hp {item}: must be in ({low:g}, {high:g})")
    return hp


def check_out(args, default):
    """--out (or default): a JSONL file or a new one its folder can hold; /dev/null
    discards the records (said so), and keeps nothing to --resume."""
    if args.out is None:
        args.out = default
    if args.out == os.devnull:
        require(not args.resume, f"--resume: --out {os.devnull} keeps nothing to resume")
        return print(f"note: --out {os.devnull}: the records are discarded")
    folder = os.path.dirname(os.path.abspath(args.out))
    require(os.path.basename(args.out), f"--out {args.out!r} names no file")  # "", "dir/"
    require(not os.path.isdir(args.out), f"--out {args.out} is a folder")
    if os.path.exists(args.out):  # a file that is there (its folder is, then), or a new one
        require(
            os.path.isfile(args.out), f"--out {args.out} is not a regular file (a FIFO, a device?)"
        )
        readable = os.access(args.out, os.W_OK | os.R_OK)  # (read: for --resume, and below)
        require(readable, f"--out {args.out} is not readable and writable")
        with open(args.out, "rb") as f:  # records go after records: never onto another file
            first = f.readline(1 << 20).strip(b" \t\r\n\x00")  # (a crash's NULs: a JSONL)
        require(not first or first.startswith(b"{"), f"--out {args.out} is not a JSONL file")
    else:
        require(os.path.isdir(folder), f"--out {args.out}: its folder does not exist")
        require(os.access(folder, os.W_OK), f"--out {args.out} is not writable")


def check_model(name):
    """A timm name, with a pretrained tag timm knows if it has one."""
    require(timm.is_model(name), f"unknown timm model {name!r}")
    try:
        timm.models.get_pretrained_cfg(name)
    except RuntimeError as e:
        fail(f"{e}; tags: {', '.join(timm.list_pretrained(name.split('.')[0] + '.*'))}")


def check_batchnorm(model, name, method, bn, per_sample=True):
    """--bn needs BatchNorm, and per-sample gradients (dp_, --clip) need it frozen; said in the
    CLI's words."""
    has_bn = any(isinstance(m, BATCH_NORM) for m in model.modules())
    require(bn is None or has_bn, f"--bn {bn}: {name} has no BatchNorm")
    require(
        not (per_sample and has_bn) or bn == "source",
        f"{name} has BatchNorm, which normalizes with the test batch and so mixes its samples: {method} needs per-sample gradients; --bn source freezes it at its source statistics",
    )


def open_folder(folder):
    """A WnidFolder, or one line and exit 2 (missing, empty, not wnids)."""
    require(os.path.isdir(folder), f"missing {folder}; {LAYOUT}")
    try:
        return WnidFolder(folder)
    except (OSError, ValueError) as e:
        fail(f"{folder}: {one_line(e)}; {LAYOUT}")


def open_streams(corruptions, root, severity):
    """{corruption: WnidFolder}, every folder listed and checked before the first image. A
    file in two corruptions' folders (a link: its device and inode) is refused in every
    setting: each image is in one step (the same *photo* in each corruption is by design,
    --privacy-unit photo). No file is stat'ed a second time: the listings' nodes are read."""
    folders = {c: os.path.join(root, c, str(severity)) for c in corruptions}
    streams = {c: open_folder(root if c == "imagenet_r" else f) for c, f in folders.items()}
    seen = {}
    for node, path in (n for ds in streams.values() for n in ds.nodes.items()):
        or_fail(reached_once, seen, path, node)
    return streams


def build_model(name, checkpoint=None, random_weights=False, seed=0):
    """A timm model: pretrained, from a local checkpoint, or random (from the seed: a smoke
    run's rerun and resume see the same weights)."""
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, pretrained=not (random_weights or checkpoint))
    except Exception as e:  # no network, no cache, ...
        cfg = timm.models.get_pretrained_cfg(name)
        where = [getattr(cfg, k, None) for k in ("hf_hub_id", "url")] + [name]
        where = next(w for w in where if w)
        fail(
            f"cannot load {name}'s weights ({where}): {one_line(e)}; offline: pass --checkpoint PATH, or HF_HUB_OFFLINE=1 for a local cache"
        )
    if checkpoint:
        try:
            timm.models.load_checkpoint(model, checkpoint)
        except Exception as e:
            fail(f"--checkpoint {checkpoint} does not fit {name}: {one_line(e)}")
    return model


def weights_digest(model):
    """SHA-256 of the model's parameters and buffers as built: a hub's weights may change under
    one name, and a resumed run must go on with the model its records so far came from."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# ----------------------------------------------------------------------------
# Records: whole lines of standard JSON, appended; a run's state, saved after each stream
@functools.lru_cache
def checkpoint_digest(path, size, mtime_ns):
    """SHA-256 of a checkpoint's bytes, read once per process for a (path, size, time): the
    grid keys each of its cells by it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(partial(f.read, 2**24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_key(args):
    """Everything that changes a result (the seed too: --summarize groups seeds). --summarize
    makes a table of each setting, the key less PER_CELL: a field added here that varies
    within a table belongs in PER_CELL too."""
    names = (
        "method eps delta privacy_unit clip lr hp batch_size setting order repeat "
        "accumulate dataset severity corruptions model bn seed noise_seed limit dtype"
    )
    key = {k: getattr(args, k) for k in names.split()}
    if args.synthetic:
        key["weights"], key["data"] = "random", f"synthetic:{args.synthetic}"
    else:
        key["weights"], key["data"] = "pretrained", os.path.realpath(args.data)
    if args.checkpoint:  # by its bytes: a touched or copied checkpoint is the same weights
        st = os.stat(args.checkpoint)
        digest = checkpoint_digest(os.path.realpath(args.checkpoint), st.st_size, st.st_mtime_ns)
        key["weights"] = dict(checkpoint_sha256=digest)
    key["fisher_data"] = None if args.fisher_data is None else os.path.realpath(args.fisher_data)
    return json.loads(json.dumps(jsonable(key)))  # as it reads back: lists, not tuples


def jsonable(x):
    """x with its non-finite floats as "inf", "-inf" and "nan" (JSON has none; float() reads them)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def read_jsonl(path, flag):
    """[(line number, record)] of a JSONL file. A damaged line (a record cut by a crash or a
    full disk, NUL bytes) is skipped and named; a file with no record is refused as not a
    JSONL file, unless every line of it starts like a record."""
    require(os.path.isfile(path), f"{flag} {path} does not exist or is not a regular file")
    require(os.access(path, os.R_OK), f"{flag} {path} is not readable")
    records, damaged = [], {}  # damaged: line number -> whether it starts like a record
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip(b" \t\r\n\x00")
            try:
                record = json.loads(line) if line else {}
            except (ValueError, RecursionError):  # bad JSON, bad UTF-8, nested 100,000 deep
                record = None
            if isinstance(record, dict) and line:
                records.append((n, record))
            elif line:  # damaged: a cut record starts with "{", binary or another format not
                damaged[n] = line.startswith(b"{")
    require(records or all(damaged.values()), f"{path} has no JSON line: not a JSONL file?")
    if damaged:
        warn(f"{path}: skipped {len(damaged)} damaged line(s) ({first_few(list(damaged))})")
    return records


def first_few(line_numbers):
    """Line numbers as a warning shows them: "3, 7, 9", or the first five and "..."."""
    shown = ", ".join(map(str, line_numbers[:5]))
    if len(line_numbers) > 5:
        shown += ", ..."
    return shown


def append_jsonl(path, record):
    """Appends one whole line (after closing a last line a crash left unended), written by
    O_APPEND so that lines never interleave; failing (a full disk): prints it, exit 4."""
    text = json.dumps(jsonable(record), allow_nan=False)
    line = (text + "\n").encode()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            if end and os.pread(fd, 1, end - 1) != b"\n":
                line = b"\n" + line
            while line:  # a short write goes on
                line = line[os.write(fd, line) :]
        finally:
            os.close(fd)
    except OSError as e:
        print(text, flush=True)
        fail(f"cannot write {path} ({e.strerror}); the record is above", 4)


def create_private(path, mode):
    """A new file that this run alone created and only its owner reads (0600), open in `mode`.
    A file planted at `path` in a shared folder (its own mode, or a link) is removed, never
    written through: O_EXCL creates the file this run owns, or fails."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    return os.fdopen(os.open(path, flags, 0o600), mode)


def save_state(path, state, first=False):
    """torch.save to a file only its owner reads (it holds the noise stream's key: as secret as
    the data), synced to disk, then a rename: a kill or a power cut leaves the old state or the
    new one, never the .tmp, and never records on disk that their state is not. A save that
    fails stops the run (exit 4) before anything of the stream it follows is shown: --resume
    streams it again from the last state, and only that pass is seen."""
    if path is None:  # --out /dev/null: nothing to resume
        return
    try:
        with create_private(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename, the stream's line and records
        os.replace(path + ".tmp", path)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:  # the rename on disk too, before the stream it follows is shown
            os.fsync(folder)
        finally:
            os.close(folder)
    except (OSError, RuntimeError) as e:  # torch.save's full disk is a RuntimeError
        if first:
            fail(f"cannot save the run's state {path} ({one_line(e)}); no image was read", 4)
        last = "--resume goes on from the last one"
        fail(f"cannot save the run's state {path} ({one_line(e)}); {last}", 4)
    finally:  # a failure, or a signal in the middle (KeyboardInterrupt)
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")


# ----------------------------------------------------------------------------
# The privacy ledger and the header
def photo_factor(streams, mixed):
    """μ_photo²/μ_step² for one round: a photo's versions are in `streams` steps, or, in one
    mixed stream, may share a step: m of them in one batch move its sum by 2mC, and
    Σ m² <= streams² (all in one batch) is the worst case."""
    return streams**2 if mixed else streams


def privacy_ledger(adapter, streams, rounds, privacy_unit, mixed):
    """What the adapter promises, to whom, in numbers. A step (its `releases`, σ_l each) is
    μ-GDP with μ = 2/σ, σ = σ_l/√releases; a test image is in `rounds` steps (--repeat), a
    photo in streams × rounds (mixed: see photo_factor); k steps are μ√k-GDP (Dong, Roth &
    Su, Cor. 3.3)."""
    if not adapter.method.private:
        return dict(private=False, clip=adapter.clip)
    if adapter.sigma == 0:  # ε = inf: the DP recipe with no noise
        note = "clip only, not private"
        return dict(private=False, clip_only=True, note=note, eps=adapter.eps, clip=adapter.clip)
    sigma, delta = adapter.sigma / math.sqrt(adapter.releases), adapter.delta
    k, photo = photo_factor(streams, mixed) * rounds, f"{streams} stream(s) x {rounds} round(s)"
    if mixed:
        photo = f"{streams} version(s) in one mixed stream, a step at worst, x {rounds} round(s)"
    unit = f"one test image, replaced in place in a public order, in {rounds} step(s)"
    if privacy_unit == "photo":
        unit = f"one photo, replaced in place in a public order, its {photo}"
    ledger = dict(private=True, eps=adapter.eps, delta=delta, privacy_unit=privacy_unit, unit=unit)
    ledger.update(
        clip=adapter.clip, sigma=sigma, releases=adapter.releases, sigma_per_release=adapter.sigma
    )
    for per, steps in (("step", 1), ("test_image", rounds), ("photo", k)):
        ledger[f"mu_per_{per}"] = 2 * math.sqrt(steps) / sigma
        ledger[f"eps_per_{per}"] = gdp_epsilon(sigma=sigma / math.sqrt(steps), delta=delta)
    ledger.update(rounds=rounds, streams=streams, photo=photo, noise="secret")
    if adapter.noise_seed is not None:
        note = f"not private against anyone who knows noise seed {adapter.noise_seed}"
        ledger.update(noise="replayed", noise_seed=adapter.noise_seed, note=note)
    return ledger


def wild(settings):
    """The settings unlike the paper's, as " | order class | repeat 3"."""
    plain = dict(order="random", repeat=1, accumulate=1)
    return "".join(
        f" | {k} {settings.get(k, v)}" for k, v in plain.items() if settings.get(k, v) != v
    )


def print_header(args, adapter, ledger, hp_note):
    """The run's header: what runs where, its data, its privacy ledger and its θ."""
    where = args.device
    if args.device == "cuda":
        where += f" ({torch.cuda.get_device_name()})"
    print(f"dptta | {args.method} | {args.model} | {where} | {args.dtype}")
    if args.synthetic:
        weights = "checkpoint" if args.checkpoint else "random"
        smoke = f"{args.synthetic} random images per corruption, {weights} weights"
        print(f"SMOKE RUN: {smoke}: accuracy is chance")
    data = f"{args.data} | {args.dataset}"
    if args.dataset == "imagenet_c":
        data += f" severity {args.severity}"
    data += f" | {len(args.corruptions)}"
    run = f"{args.setting} | batch {args.batch_size} | seed {args.seed}{wild(vars(args))}"
    print(f"data: {data} stream(s) | {run}")
    what, released = "", "adapted θ"
    if adapter.clip:
        what = f"C = {adapter.clip:g} [{hp_note['clip']}]"
    if adapter.bn_src:  # dp_norm: σ_l = √L·σ for each of its L layers
        L, scale = adapter.releases, adapter.hp["bn_scale"]
        what = f"L = {L} BN layers, each σ_l = √L·σ = {adapter.sigma:.4f}"
        what += f", moments clipped to {scale:g}·√(2·channels)"
        released = f"the {L} layers' BatchNorm statistics"
    if ledger["private"]:  # the ledger's numbers, a line for each unit they count
        for line in (
            "privacy: ({eps:g}, {delta:g})-DP per {privacy_unit} | σ = {sigma:.4f} per step (μ = 2/σ = {mu_per_step:.4f}-GDP), {what}",
            "  per test image ({rounds} step(s)): μ = {mu_per_test_image:.4f}, ε = {eps_per_test_image:.3g}",
            "  per photo ({photo}): μ = {mu_per_photo:.4f}, ε = {eps_per_photo:.3g}",
            "  unit: {unit}; released: {released} and every prediction for other images",
        ):
            print(line.format(**ledger, what=what, released=released))
        if ledger["noise"] == "secret":
            print("  noise: secret, from OS entropy; the state file holds it: keep it private")
        else:
            print(f"  noise: NOT SECRET: replayed from --noise-seed {adapter.noise_seed}")
            print(f"  ({ledger['note']})")
    elif ledger.get("clip_only"):
        unfiltered = "no noise and no filter (an original with --clip keeps its filter)"
        print(f"privacy: NONE: clip only (eps = inf), not private: {unfiltered}; {what}")
    elif args.method != "source" and what:
        print(f"not private; per-sample clip {what}")
    elif args.method != "source":
        print("not private; no clipping")
    if adapter.params:
        n = sum(p.numel() for p in adapter.params.values())
        hp = "".join(f" | {k}={v:g}" for k, v in args.hp.items())
        print(f"lr {adapter.lr:g} [{hp_note['lr']}] | SGD momentum 0.9{hp}")
        print(f"  adapting {len(adapter.params)} tensors, {n:,} scalars")
    if ledger.get("bn") == "private statistics":
        print(f"BatchNorm: private statistics in {adapter.releases} layer(s), the others frozen")
    elif "bn" in ledger:
        print(f"BatchNorm: {adapter.bn} (train: the test batch's statistics; source: frozen)")


def print_norm_noise(adapter, batch_size):
    """dp_norm's noise, known before the first image: per release τ = σ_l·c/B, and of the
    long average; a warning where it exceeds what the average can carry in every layer."""
    release, average = [], []
    for mean, _ in adapter.bn_src.values():
        c = adapter.moment_clip(len(mean))
        tau2 = release_noise(adapter.sigma, c, batch_size)
        gain = norm_gain(tau2)
        release.append(math.sqrt(tau2))
        average.append(math.sqrt(tau2 * gain / (2 - gain)))  # the steady noise of the average
    least, spread = min(average), f"{min(release):.3g}-{max(release):.3g}"
    print(f"DP-Norm noise per coordinate (z units): per release {spread},", end=" ")
    print(f"of the average {least:.3g}-{max(average):.3g}; shifts below it stay at the source")
    if least > NORM_HOPELESS:
        warn(
            f"dp_norm's averaged statistics carry noise of at least {least:.3g} per coordinate in every layer: it will stay near the source statistics (larger batches, a larger ε or fewer --hp bn_layers help)"
        )


# ----------------------------------------------------------------------------
# main: the stream, corruption by corruption
def stop_the_run(message, state):
    """Exit 3: the stream stopped the run (it diverged, or a corruption has no readable image),
    and there is nothing to resume. Its state goes before the message, which may tell of the
    stream's releases (the batch that diverged): such a stream is never streamed again."""
    remove_state(state)
    fail(message, 3)


def stop_unless_finite(adapter, where, *tensors, state=None):
    """θ and the tensors (logits) are finite (one device sync), or exit 3: NaN logits would
    predict class 0 and be scored."""
    checks = [torch.isfinite(t.detach()).all() for t in (*adapter.params.values(), *tensors)]
    if checks and not torch.stack(checks).all():
        diverged = f"θ or the logits are not finite after {where} (lr or clip too large?)"
        stop_the_run(f"{diverged}; stopped, no record of this corruption or run", state)


def autocast(args):
    """bf16 autocast on CUDA; the clip, the noise and the step stay in fp32."""
    return torch.autocast(args.device, torch.bfloat16, enabled=args.dtype == "bf16")


def rate(n, seconds):
    return f"{n / max(seconds, 1e-9):.3g} img/s"


def progress(loader, what):
    """The loader's batches, and a progress line at least every PROGRESS_SECONDS."""
    t0 = last = time.time()
    images = 0
    with batches_of(loader) as batches:
        for batch in batches:
            yield batch
            images += len(batch[2]) if batch[0] is None else len(batch[0])
            if time.time() - last > PROGRESS_SECONDS:
                last = time.time()
                print(
                    f"  {what}: {images}/{len(loader.dataset)} images, {rate(images, last - t0)}",
                    flush=True,
                )


def stream_through(adapter, loader, label, *, args, lookup, shape, groups=1, state=None):
    """The adapter on one stream: (correct, scored) per group (mixed: per corruption), and
    the unreadable images' paths. shape: an image's, [3, H, W], for a batch of placeholders.
    Its progress lines count images, never what the releases predicted: nothing computed from
    a release leaves the run before the state that holds it is saved (a killed stream is
    streamed again with its noise, and only that pass is seen)."""
    correct, scored = torch.zeros(2, groups, dtype=torch.long, device=args.device)
    unreadable, t0 = [], time.time()
    last = t0
    with batches_of(loader) as batches:
        for i, (x, y, bad) in enumerate(batches):
            if STOP:  # a signal a DataLoader worker swallowed stops the run all the same
                raise KeyboardInterrupt
            for path in bad:
                print(f"  unreadable, skipped: {path}", flush=True)
            unreadable += bad
            if x is None:  # none of the batch decodes: all gray, as each alone would be (a batch
                # skipped would change the windows and the count of steps: they read one file)
                x, y = torch.zeros(len(bad), *shape), torch.full((len(bad),), -1)
            x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
            if lookup is not None:  # ImageNet-1k index -> its index among the classes scored
                y = torch.where(y >= 0, lookup[y.clamp(min=0)], y)
            group = torch.where(y >= 0, y // Mixed.TAG, 0)
            y = torch.where(y >= 0, y % Mixed.TAG, y)  # placeholders (−1) are never scored
            with autocast(args):
                logits = adapter(x)
            stop_unless_finite(adapter, f"batch {i + 1} of {label}", logits, state=state)
            correct += torch.bincount(group[logits.argmax(1) == y], minlength=groups)
            scored += torch.bincount(group[y >= 0], minlength=groups)
            if (i + 1) % args.log_every == 0 or time.time() - last > PROGRESS_SECONDS:
                last, seen = time.time(), scored.sum().item()
                print(f"  {label} {seen}/{len(loader.dataset)} {rate(seen, last - t0)}", flush=True)
    with autocast(args):
        adapter.flush()  # the last, partial accumulate window steps too
    stop_unless_finite(adapter, f"the last step of {label}", state=state)
    return correct.tolist(), scored.tolist(), unreadable


def drift_of(adapter):
    """How far adaptation has moved, public (a function of the releases): ‖θ − θ0‖, or
    dp_norm's statistics' distance from the source's in z units; None for no state."""
    if adapter.bn_src:
        total = 0.0
        for name, (mean, _) in adapter.bn_src.items():
            if name in adapter.state:
                a, ratio = estimated(adapter.state[name], len(mean))
                total += a.pow(2).sum().item() + (ratio - 1).pow(2).sum().item()
        return math.sqrt(total)
    if not adapter.params:
        return None
    total = 0.0
    for name, p in adapter.params.items():  # in float64: a far θ's squares overflow fp32
        total += (p.detach().double() - adapter.theta0[name].double()).pow(2).sum().item()
    return math.sqrt(total)


def _stop(signum, frame):
    """A signal stops the run: the first raises KeyboardInterrupt; a later one is only recorded
    (raised inside the cleanup, stopping the loader's workers, it would leave them running and
    the run waiting for them forever)."""
    STOP.append(signum)
    if len(STOP) == 1:
        raise KeyboardInterrupt


@contextlib.contextmanager
def signals_stop_it():
    """SIGINT, SIGTERM and SIGHUP (a dropped ssh session) raise KeyboardInterrupt (_stop) while
    a run or a benchmark lives, so that its cleanup runs (temp trees, workers, the lock): by
    default the last two kill the process where it stands."""
    handlers = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    STOP.clear()
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def main(argv=None):
    args = parse_args(argv)
    if args.summarize is not None:
        check_common(args, "summarize")
        return summarize(args.summarize, args.per_corruption, args.error)
    if args.benchmark:
        with signals_stop_it():
            return benchmark(args)
    if args.audit:
        return audit_cli(args)
    check_args(args)
    hp_note = fill_in_hparams(args)
    key = run_key(args)
    run_hash = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(key, sort_keys=True))
    # the run's state after each stream holds the noise stream's key: as secret as the data
    # (by the real path of --out: a run through a symlink to it is the same cell's)
    state = None if args.out == os.devnull else f"{os.path.realpath(args.out)}.{run_hash}.pt"
    with one_run_of(state), signals_stop_it():
        return adapt_resumably(args, key, hp_note, state)


def fill_in_hparams(args):
    """--clip and --lr not given: the paper's tuned values, or one line where it has none.
    Returns where each came from."""
    tuned_on = "continual" if args.setting == "mixed" else args.setting
    C, lr, source = paper_hparams(args.method, args.eps, tuned_on, args.clip)
    hp_note = {k: "given" if getattr(args, k) else source for k in ("clip", "lr")}
    if args.clip is None:
        args.clip = C
    if args.lr is None:
        args.lr = lr
    record = METHODS[args.method]
    if record.step in ("plain", "sam"):  # a gradient step needs an lr, and dp_ a clip
        require(args.lr, f"{args.method}: {source}; pass --lr (and --clip for dp_)")
        require(args.clip or not record.private, f"{args.method}: {source}; pass --clip")
    return hp_note


@contextlib.contextmanager
def one_run_of(state):
    """The run's lock, held while it lives: a second run of the same cell (a hand run beside a
    grid, two --resume) would release its images again and write every record twice. The
    lock is flock's, which ends with the process: a killed run's never blocks its --resume."""
    if state is None:  # --out /dev/null: nothing written, nothing to resume
        yield
        return
    lock = state.removesuffix(".pt") + ".lock"
    try:
        f = open(lock, "a")
    except OSError as e:  # (a name too long, a folder gone)
        fail(f"cannot create the run's lock {lock}: {one_line(e)}; no image was read", 4)
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(f"another run of this cell is running (it holds {lock}): wait for it to end")
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):  # (removed already: nothing held)
                os.remove(lock)


def adapt_resumably(args, key, hp_note, state):
    """The run, after a killed one's state if --resume finds it; stopped by a signal, it says
    what is kept."""
    mine = []  # this run's records already in --out
    if state and os.path.exists(args.out):
        mine = [r for _, r in read_jsonl(args.out, "--out") if r.get("key") == key]
    finished = any(r.get("mode") == "adapt" for r in mine)  # its final record is in --out
    killed = state is not None and os.path.exists(state)  # a killed run's state is left
    if args.resume and finished:
        print(f"already in {args.out}: {args.method} eps={args.eps} seed={args.seed}; skipped")
        remove_state(state)  # a kill between the run's record and the state's removal
        return 0
    if finished:  # (the user's choice: said)
        warn(
            f"{args.out} holds this run already: this one releases its images again, and both "
            "runs' releases count (--resume would skip it)"
        )
    unfinished = any(r.get("mode") == "corruption" for r in mine) and not finished
    if unfinished and not killed and not args.resume:  # (a diverged run's: said)
        warn(
            f"{args.out} holds records of an unfinished run of this cell: this one releases "
            "their images again, and both runs' releases count"
        )
    if killed and not args.resume:  # (the user's choice: said)
        warn(
            f"{state}: a killed run of this cell, replaced: this run starts afresh, and its "
            "releases and the killed run's both count (--resume would go on)"
        )
    if args.resume and state and not killed:
        refuse_a_moved_run(args, key, state)
    resume = None
    if args.resume and killed:
        resume = read_state(state)
        require(resume is not None, f"{state} is not a file of this user's that only it reads")
        try:  # a killed run's state (weights_only: tensors and plain data, no code)
            resume = torch.load(io.BytesIO(resume), map_location=args.device, weights_only=True)
            if not (isinstance(resume, dict) and {"key", "run_id", "records"} <= set(resume)):
                raise ValueError("not a run's state")
        except Exception as e:
            again = "starting it afresh would release its images again; remove it and"
            fail(f"{state} is damaged ({one_line(e)}): its run cannot go on, and {again} {NEW_RUN}")
    elif args.resume and unfinished:
        lacks = f"{args.out} holds corruption records of this run but not its state ({state})"
        fail(f"--resume: {lacks}: it cannot go on without releasing their images again; {NEW_RUN}")
    status = {}  # the run's bookkeeping, "run", as it goes (adapt_and_record)
    try:
        with contextlib.ExitStack() as cleanup:  # the smoke run's tree goes on every exit path
            if args.synthetic:
                args.data = cleanup.enter_context(
                    tempfile.TemporaryDirectory(prefix="dptta-synthetic-")
                )
                make_synthetic_tree(args.data, args.corruptions, args.severity, args.synthetic)
            return adapt_and_record(args, key, hp_note, state, resume, mine, status)
    except UnreadableFile as e:  # (from a DataLoader worker: its message quotes its traceback)
        unread = re.findall(r"cannot read [^\n]*", str(e))[-1]
        hint = ": --resume goes on once it reads" if state and os.path.exists(state) else ""
        fail(f"{unread}; stopped before stepping on its batch{hint}", 4)
    except KeyboardInterrupt:
        signum, run = STOP[0] if STOP else signal.SIGINT, status.get("run", {})
        name = signal.Signals(signum).name
        if run.get("final"):  # after the final record: the run is whole
            remove_state(state)
            print(f"dptta: {name} after the run's final record: it is complete", file=sys.stderr)
            return 0
        done = status.get("recorded", 0)  # streams whose records are in --out (not just saved)
        recorded = f"{done} stream(s) recorded in {args.out}" if done else "no stream recorded"
        resumable = state is not None and os.path.exists(state)
        how = "--resume goes on" if resumable else "nothing to resume"
        print(f"dptta: stopped by {name}; {recorded}, no final record ({how})", file=sys.stderr)
        return 128 + signum


def read_state(path):
    """A run state's bytes, or None where it is not a file of this user's that only it reads
    (checked on the file opened, never through a link: no other file can take its place)."""
    with contextlib.suppress(OSError), open(path, "rb", opener=no_link) as f:
        st = os.fstat(f.fileno())
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o77:
            return f.read()
    return None


def refuse_a_moved_run(args, key, state):
    """--resume with no state for this key, beside a killed run's state whose key differs
    only in where its data was (a copied or moved tree, its Fisher images) or its dtype
    (--device auto on another machine): that run would start afresh, releasing its images
    again under fresh noise, and leave its secret state behind. Refused, naming it."""
    folder, name = os.path.split(state.removesuffix(".pt").rpartition(".")[0])
    moved = {"data", "fisher_data", "dtype"}
    for entry in sorted(os.listdir(folder)):
        other = os.path.join(folder, entry)
        if not (entry.startswith(name + ".") and entry.endswith(".pt")) or other == state:
            continue
        saved = read_state(other)
        with contextlib.suppress(Exception):  # (not a state: another file; never loaded as code)
            saved = torch.load(io.BytesIO(saved), weights_only=True)["key"]
        if not isinstance(saved, dict) or set(saved) != set(key):
            continue
        differ = {k for k in key if saved[k] != key[k]}
        if differ and differ <= moved:
            shown = ", ".join(f"{k} {saved[k]} (now {key[k]})" for k in sorted(differ))
            how = f"--resume it as it ran, or remove it and {NEW_RUN}"
            fail(f"{other} is a killed run of this cell with {shown}: {how}")


def open_inputs(args):
    """The run's folders, listed and checked before the first image (the grid's preflight
    opens every cell's): (streams, every folder read, Fisher loader)."""
    streams = open_streams(args.corruptions, args.data, args.severity)
    folders = dict(streams)  # every folder the run reads: its transform, its fingerprint
    fisher_loader = None
    if args.fisher_data:  # the images the Fisher pass reads, checked before the first image
        fisher_set, size = open_folder(args.fisher_data), args.hp.get("fisher_size", 2000)
        folders["--fisher-data"] = fisher_set
        fisher_loader = image_stream(
            fisher_set, args.batch_size, seed=args.seed, workers=args.workers, limit=size
        )
        check_public(fisher_set, streams, fisher_loader.dataset.indices)
        if args.privacy_unit == "photo":
            warn(
                "--fisher-data under --privacy-unit photo: its images must not be photos the streams are made of (ImageNet-C's come from ImageNet val)"
            )
    return streams, folders, fisher_loader


def open_run(args):
    """Every input opened and checked before the first image: (streams, every folder read,
    Fisher loader, model, its data config, the scored classes' lookup, the weights' digest)."""
    streams, folders, fisher_loader = open_inputs(args)
    model = build_model(args.model, args.checkpoint, bool(args.synthetic), args.seed)
    weights = weights_digest(model)
    config = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**config)
    for folder in folders.values():
        folder.transform = transform
    check_fits(args, model, config, streams)
    lookup = None
    if args.dataset == "imagenet_r":  # the 1000-way head read at the classes present
        classes = sorted(set(streams["imagenet_r"].imagenet_index))
        scored = torch.as_tensor(classes, device=args.device)
        model.register_forward_hook(lambda m, x, out: out[:, scored])
        lookup = torch.full((1000,), -1, device=args.device)
        lookup[classes] = torch.arange(len(classes), device=args.device)
    model = model.to(args.device)
    if args.device == "cuda" and not hasattr(model, "blocks"):  # conv trunks like channels_last
        model = model.to(memory_format=torch.channels_last)
    return streams, folders, fisher_loader, model, config, lookup, weights


def check_fits(args, model, config, streams):
    """The run's flags against its model and data, before the first image (the grid checks
    each cell's before its first cell)."""
    side = min(config["input_size"][1:])
    require(
        args.hp.get("patch_grid", 1) <= side,
        f"--hp patch_grid={args.hp.get('patch_grid')}: more patches than {side} pixels",
    )
    per_sample = args.clip is not None and METHODS[args.method].step in ("plain", "sam")
    check_batchnorm(model, args.model, args.method, args.bn, per_sample)
    logits = getattr(model, "num_classes", 0)
    if args.dataset == "imagenet_r":  # scored at the classes present
        logits = len(set(streams["imagenet_r"].imagenet_index))
    require(
        args.hp.get("num_classes", logits) >= logits,
        f"--hp num_classes={args.hp.get('num_classes')} is below the model's {logits} logits",
    )


def make_adapter(args, model, config):
    """The run's DPTTA, as its flags ask, or one line and exit 2 (dp_norm: its layers'
    releases counted on a data-free forward)."""
    hp = {k: v for k, v in args.hp.items() if k != "fisher_size"}
    # the flags DPTTA takes as they are, then those the CLI counts or defaults for it
    given = "eps clip lr seed noise_seed accumulate".split()
    kwargs = {k: getattr(args, k) for k in given}
    # a photo's versions: in k steps (k streams), or one at worst (mixed)
    photo = photo_factor(len(args.corruptions), args.setting == "mixed")
    kwargs["repeats"] = args.repeat * (photo if args.privacy_unit == "photo" else 1)
    kwargs["delta"] = 1e-6 if args.delta is None else args.delta
    kwargs["bn"] = "train" if args.bn is None else args.bn
    adapter = or_fail(DPTTA, model, args.method, **kwargs, **hp)
    if args.privacy_unit == "photo" and args.setting == "mixed":  # k versions may share a step:
        # a sum moved by 2kC, μ = 2k/σ, the reach checked at σ/k (its releases: one per round)
        k, releases = len(args.corruptions), adapter.releases * args.repeat
        or_fail(check_noise_reach, adapter.sigma / k, kwargs["delta"], releases)
    if adapter.bn_src:  # dp_norm: one release per layer, refused before the first image
        device = next(model.parameters()).device
        or_fail(adapter.check_releases, torch.zeros(1, *config["input_size"], device=device))
    return adapter


def fisher_of(args, model, adapter, fisher_loader):
    """EATA's Fisher information on --fisher-data's readable images (an unreadable one's gray
    placeholder is no image); one line and exit 2 where none is readable."""
    clean_images = len(fisher_loader.dataset)
    print(f"EATA's Fisher information on {clean_images} clean images ...", flush=True)
    unreadable = []

    def clean():
        for x, y, bad in progress(fisher_loader, "Fisher"):
            unreadable.extend(bad)
            if x is not None and (y >= 0).any():
                yield x[y >= 0].to(args.device)

    with autocast(args):
        fisher = fisher_information(model, adapter.params, clean(), clean_images)
    require(len(unreadable) < clean_images, "--fisher-data: none of its images is readable")
    if unreadable:
        skipped = f"{len(unreadable)} unreadable image(s) skipped ({unreadable[0]}, ...)"
        warn(f"--fisher-data: {skipped}")
    return fisher


DRIFT_LABEL = {False: "‖θ−θ0‖", True: "stats from source (z)"}  # a stream line's drift


def adapt_and_record(args, key, hp_note, state, resume, mine, status):
    """Opens every input, then adapts: after each stream it saves the state, then shows the
    stream's line and appends its records; then the run's record.
    status["run"]: the run's bookkeeping as it goes (what a signal's message reads)."""
    streams, folders, fisher_loader, model, config, lookup, weights = open_run(args)
    adapter = make_adapter(args, model, config)
    mixed = args.setting == "mixed"
    if fisher_loader is not None:
        adapter.hp["fisher"] = fisher_of(args, model, adapter, fisher_loader)
    elif "fisher" in adapter.hp:
        warn(f"{args.method} without --fisher-data: no anti-forgetting penalty")
    ledger = privacy_ledger(adapter, len(streams), args.repeat, args.privacy_unit, mixed)
    if any(isinstance(m, BATCH_NORM) for m in model.modules()):  # what BatchNorm normalized with
        ledger["bn"] = "private statistics" if adapter.bn_src else adapter.bn
    print_header(args, adapter, ledger, hp_note)
    if adapter.bn_src and adapter.sigma > 0:
        print_norm_noise(adapter, args.batch_size * args.accumulate)  # a release's batch
    n = min(len(ds) for ds in streams.values())
    if args.limit is not None:
        n = min(n, args.limit)
    if ledger["private"] and args.delta >= 1 / n:
        warn(f"δ = {args.delta:g} is not below 1/n = 1/{n} (n: a stream's images), the usual rule")
    sources = streams  # a run's units: each stream (mixed: all at once), each round
    if args.setting == "mixed":
        sources = {"mixed": Mixed(streams)}
    run = dict(key=key, run_id=uuid.uuid4().hex, rounds=[{} for _ in range(args.repeat)])
    run.update(drift={}, done=[], records=[], images=0, unreadable=[], wall=0.0)
    # what a resume must meet again: the shuffles' generator is its device's, and a stream
    # resumed on other files or weights would record another run's accuracy under this one's key
    run["device"], run["weights"] = args.device, weights
    run["data"] = {name: data_fingerprint(folder) for name, folder in folders.items()}
    if resume is not None:
        run = resumed(args, adapter, resume, key, state, mine, run)
    start = time.time() - run["wall"]
    status["run"], status["recorded"] = run, len(run["done"])
    if resume is None:  # a kill in the first stream resumes from here, its noise where it was
        remove_state(state)  # (a killed run's, replaced: stopped before this one's, none is left)
        save_state(state, run_state(run, adapter), first=True)
    for r, name in [(r, name) for r in range(args.repeat) for name in sources]:
        label = name if args.repeat == 1 else f"{name}#{r + 1}"
        if label in run["done"]:
            continue
        if args.setting == "episodic":
            adapter.reset()
        stream = dict(workers=args.workers, limit=args.limit, order=args.order, rerun=r)
        stream["pin_memory"] = args.device == "cuda"
        loader = image_stream(sources[name], args.batch_size, seed=args.seed, **stream)
        t0, groups = time.time(), list(streams) if name == "mixed" else [name]
        shape = config["input_size"]
        correct, scored, bad = stream_through(
            adapter,
            loader,
            label,
            args=args,
            lookup=lookup,
            shape=shape,
            groups=len(groups),
            state=state,
        )
        for c, images in zip(groups, scored):  # a 0% of no image would be a made-up measurement
            if not images:
                unread = f"{c}: no image of it could be read"
                stop_the_run(f"{unread}; stopped, no record of it or the run", state)
        run["images"] += sum(scored)
        run["unreadable"] += bad
        run["drift"][label] = drift = drift_of(adapter)
        moved = "" if drift is None else f" | {DRIFT_LABEL[bool(adapter.bn_src)]} {drift:.4f}"
        records, lines = [], []
        common = dict(mode="corruption", run_id=run["run_id"], key=key, round=r + 1)
        for c, hits, images in zip(groups, correct, scored):
            run["rounds"][r][c] = top1 = 100 * hits / max(images, 1)
            record = dict(common, corruption=c, accuracy=top1, error=100 - top1, images=images)
            skipped = sum(path in streams[c].files for path in bad)  # (mixed: its own files)
            records.append(dict(record, skipped=skipped, drift=drift, smoke=bool(args.synthetic)))
            note = f" | {skipped} unreadable image(s) skipped" if skipped else ""
            speed = rate(images, time.time() - t0)
            lines.append(f"{c:<18} top-1 {top1:5.1f}% | {images} images | {speed}{moved}{note}")
        run["done"].append(label)
        run["records"] += records
        # the state first, then the stream's lines and records: a kill between the two loses
        # nothing (--resume writes the records it finds in the state) and repeats nothing, and
        # a kill before it has shown nothing of the stream's releases
        save_state(state, run_state(dict(run, wall=time.time() - start), adapter))
        print("\n".join(lines), flush=True)
        for record in records:
            append_jsonl(args.out, record)
        status["recorded"] += 1
    finish(args, run, streams, adapter, ledger, hp_note, start)
    remove_state(state)
    return 0


def remove_state(state):
    """A run's state, where it exists (--out /dev/null: none), and the release log that a
    dptta before this one kept beside it."""
    for path in (state, f"{state}.releases") if state else ():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def run_state(run, adapter):
    """What --resume needs: the run's bookkeeping, the adapter's checkpoint, and its noise
    stream's state. A killed stream is streamed again from the start, drawing the noise it
    drew before. Nothing computed from its releases had left the run (no line, no record:
    see stream_through), so its second pass is the only one anyone sees: no release counts
    twice, even where other arithmetic (a GPU's kernels) makes it differ from the first. Had
    both passes been seen, the two releases of one batch would share their noise, and their
    difference would show the difference of the two sums without any."""
    return dict(run, adapter=adapter.get_extra_state(), noise=adapter.noise.get_state())


def resumed(args, adapter, resume, key, state, mine, run):
    """A killed run's bookkeeping and its adapter where it stood; the records the state holds
    but the file lacks (a kill between the two) are written now, once."""
    require(resume["key"] == key, f"{state} belongs to another run; remove it")
    # (before the keyed stream "noise" was a torch generator's state; "data", "device" and
    # "weights" came later; a state with "arithmetic" is from a dptta whose progress lines
    # showed a killed stream's accuracy: its stream was seen, and must not be streamed again)
    current = isinstance(resume.get("noise"), dict) and isinstance(resume.get("data"), dict)
    require(
        current and {"device", "weights"} <= set(resume) and "arithmetic" not in resume,
        f"{state} is from an older dptta: it cannot go on; {NEW_RUN}",
    )
    saved_on = resume["device"]
    elsewhere = f"{state} was saved on {saved_on}: --device {saved_on} resumes it"
    require(saved_on == args.device, elsewhere)
    mixed = "its records would mix two runs under one key"
    changed = f"{args.model}'s weights changed since {state} was saved"
    now = f"(now sha256 {run['weights'][:12]}…)"
    require(resume["weights"] == run["weights"], f"{changed} {now}: {mixed}; {NEW_RUN}")
    data = run["data"]
    for name in sorted(set(data) | set(resume["data"])):  # each folder's digest now and then
        changed = f"{name}: files changed since {state} was saved"
        require(resume["data"].get(name) == data.get(name), f"{changed}: {mixed}; {NEW_RUN}")
    adapter.set_extra_state(resume.pop("adapter"))
    adapter.noise.set_state(resume.pop("noise"))
    written = [
        (r.get("corruption"), r.get("round"))
        for r in mine
        if r.get("mode") == "corruption" and r.get("run_id") == resume["run_id"]
    ]
    saved = [(r["corruption"], r["round"]) for r in resume["records"]]
    require(
        set(written) <= set(saved),
        f"{state} is older than the records of its run in {args.out} (a save lost, or an older state put back): it cannot go on; {NEW_RUN}",
    )
    for record in resume["records"]:
        if (record["corruption"], record["round"]) not in written:
            append_jsonl(args.out, record)
    done = ", ".join(resume["done"]) if resume["done"] else "none (its first stream again)"
    print(f"resumed run {resume['run_id']} after {done}")
    return resume


def finish(args, run, streams, adapter, ledger, hp_note, start):
    """The run's record: each corruption's accuracy (the mean over rounds; each round's own
    under `rounds`, the forgetting curve), the key, the ledger, the settings."""
    accuracy = {c: float(np.mean([acc[c] for acc in run["rounds"]])) for c in streams}
    mean, wall, images = sum(accuracy.values()) / len(accuracy), time.time() - start, run["images"]
    record = dict(mode="adapt", run_id=run["run_id"], key=run["key"], settings=dict(vars(args)))
    # the run: what ran, with which privacy, where
    record.update(method=args.method, eps=args.eps, clip=adapter.clip, lr=adapter.lr, hp=args.hp)
    record.update(setting=args.setting, seed=args.seed, hparam_source=hp_note, ledger=ledger)
    record.update(smoke=bool(args.synthetic), device=args.device, dtype=args.dtype)
    record["versions"] = {"torch": torch.__version__, "timm": timm.__version__}
    # what it measured
    error = {c: 100 - a for c, a in accuracy.items()}
    record.update(accuracy=accuracy, error=error, drift=run["drift"], mean=mean, images=images)
    record.update(skipped=len(run["unreadable"]), unreadable=run["unreadable"])
    record.update(images_per_s=images / wall, wall_s=wall, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if args.repeat > 1:
        record["rounds"] = [
            dict(accuracy=acc, mean=float(np.mean(list(acc.values())))) for acc in run["rounds"]
        ]
        print("per round: " + " | ".join(f"{x['mean']:.1f}" for x in record["rounds"]))
    print("\n" + " | ".join(f"{c[:8]:>8}" for c in accuracy) + " |     mean")
    print(" | ".join(f"{a:8.1f}" for a in accuracy.values()) + f" | {mean:8.1f}")
    if run["unreadable"]:
        print(f"{len(run['unreadable'])} unreadable image(s) skipped in all")
    append_jsonl(args.out, record)
    run["final"] = True  # a signal from here on finds the run complete
    print(f"mean top-1 {mean:.2f}% | {rate(images, wall)} | {wall:.0f} s | appended to {args.out}")


# ============================================================================
# Appendix: the tools (--summarize, --benchmark, --audit)
from scipy import stats


# ----------------------------------------------------------------------------
# --summarize: the paper's tables from a results file
# the fields a record's key must hold to be read (run_key writes them, and more); every key field
# not in PER_CELL splits the tables: a field added to run_key is a new table unless added there
KEY_FIELDS = "method eps clip lr seed dataset severity model setting batch_size corruptions".split()
# what a table's cells differ in: the method, its privacy and hyperparameters, and the seed
PER_CELL = "method eps delta clip lr hp privacy_unit noise_seed accumulate fisher_data seed".split()


def finite_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def readable(record):
    """Whether --summarize can read a record: a run's or a corruption's fields, of their types
    (a method's name, a seed, an ε a number or "inf"), its numbers finite."""
    key, accuracy = record.get("key"), record.get("accuracy")
    if not (isinstance(key, dict) and all(k in key for k in KEY_FIELDS)):
        return False
    method = key["method"]
    named = isinstance(method, str) and method.strip() != ""
    if not (named and isinstance(key["corruptions"], list) and finite_number(key["seed"])):
        return False
    if method.startswith("dp_") and not is_eps(key["eps"]):
        return False
    repeat = key.get("repeat", 1)  # (a count of streams: an int >= 1)
    if not (isinstance(repeat, int) and not isinstance(repeat, bool) and repeat >= 1):
        return False
    if record.get("mode") == "corruption":
        return finite_number(accuracy) and isinstance(record.get("corruption"), str)
    # a run's accuracy: one finite number for each of its corruptions, and its mean
    each = isinstance(accuracy, dict) and sorted(accuracy) == sorted(map(str, key["corruptions"]))
    if not each:
        return False
    return all(map(finite_number, [record.get("mean"), *accuracy.values()]))


def is_eps(value):
    """An ε as a record holds it: a number > 0, or "inf"."""
    return value == "inf" or (finite_number(value) and value > 0)


def variant_of(key):
    """A run's column: non-private, clip-only, ε=inf (no noise) or ε=<eps>."""
    if not str(key["method"]).startswith("dp_"):
        return "clip-only" if key["clip"] else "non-private"
    column = f"ε={float(key['eps']):g}"  # "inf" in the file: ε=inf
    if key.get("privacy_unit") == "photo":
        column += " photo"
    if key.get("noise_seed") is not None:  # never averaged with the secret noise's runs
        column += " noise-seed (not private)"
    return column


def cell(values, error):
    v = [100 - a for a in values] if error else values
    spread = f" ± {np.std(v, ddof=1):.1f}" if len(v) > 1 else ""
    return f"{np.mean(v):.1f}{spread} (n={len(v)})"


def method_rank(label):
    """The method table's order; a method of the user's own after the built-ins."""
    name, known = label.split()[0], [m.removeprefix("dp_") for m in METHODS]
    return (known.index(name) if name in known else len(known), label)


def summarize(path, per_corruption=False, error=False):
    """Methods × variants of the complete runs, mean ± std over seeds; the rest apart. One
    table per setting (what the key holds but the method, its privacy and hyperparameters),
    one row per method: its non-private, clip-only and ε columns side by side."""
    records, unreadable = [], []  # the runs' records; the line numbers of those it cannot read
    for n, r in read_jsonl(path, "--summarize"):
        if r.get("mode") not in ("adapt", "corruption"):  # (--benchmark's or --audit's)
            continue
        if readable(r):
            records.append(r)
        else:
            unreadable.append(n)
    if unreadable:
        why = "lacking fields or finite numbers"
        warn(f"{path}: skipped {len(unreadable)} record(s) {why} (line(s) {first_few(unreadable)})")
    finals = [r for r in records if r["mode"] == "adapt"]
    done = [r["key"] for r in finals]  # a dead run rerun to the end: done
    unfinished = {}  # run_id -> the corruption records of a run with no final record
    for r in records:
        if r["mode"] == "corruption" and r["key"] not in done:
            unfinished.setdefault(r.get("run_id"), []).append(r)
    full = [r for r in finals if not r.get("smoke") and r["key"].get("limit") is None]
    tables, duplicates = {}, 0  # table -> cell (the key but the seed) -> {seed: latest record}
    for r in full:
        table = json.dumps({k: v for k, v in r["key"].items() if k not in PER_CELL}, sort_keys=True)
        cell_key = json.dumps(dict(r["key"], seed=None), sort_keys=True)
        seeds = tables.setdefault(table, {}).setdefault(cell_key, {})
        if r["key"]["seed"] in seeds:
            duplicates += 1
        seeds[r["key"]["seed"]] = r
    shown = {"dataset", "severity", "model", "setting", "batch_size", "order", "repeat"}
    apart = set()  # the fields, not in a header, that tell two tables apart (dtype, weights)
    for name in {name for table in tables for name in json.loads(table)} - shown:
        if len({json.dumps(json.loads(table).get(name), sort_keys=True) for table in tables}) > 1:
            apart.add(name)
    for table, cells in tables.items():
        runs_of = [list(seeds.values()) for seeds in cells.values()]  # a cell's runs, a seed each
        labels = print_table(json.loads(table), runs_of, error, sorted(apart))
        if per_corruption:
            print_per_corruption(runs_of, labels, error)
    if duplicates:
        print(f"\n{duplicates} record(s) repeat the seed of an earlier one: latest used")
    others = [r for r in finals if r not in full]
    if others:
        print("\nnot in the tables (smoke or --limit runs):")
    for r in others:
        key = r["key"]
        why = "smoke" if r.get("smoke") else f"limit {key.get('limit')}"
        print(f"  {run_label(key)} ({why}): mean {r['mean']:.1f}")
    if unfinished:
        print("\nunfinished runs (no final record; finished corruptions only):")
    for rs in unfinished.values():
        key, shown = rs[0]["key"], ", ".join(f"{r['corruption']} {r['accuracy']:.1f}" for r in rs)
        streams = len(key["corruptions"]) * key.get("repeat", 1)  # a record per corruption, round
        smoke = " (smoke)" if rs[0].get("smoke") else ""
        print(f"  {run_label(key)}{smoke}: {len(rs)}/{streams} corruptions: {shown}")
    if not finals and not unfinished:
        print(f"no adaptation runs in {path}")
    return 0


def run_label(key):
    """A run outside the tables, as a line names it: method, variant, C, lr, constants, setting,
    order, batch, seed (two such runs differ in one of them)."""
    hp = "".join(f" {name}={value}" for name, value in sorted(key.get("hp", {}).items()))
    where = f"{key.get('setting')}, order {key.get('order')}, batch {key.get('batch_size')}"
    run = f"{key['method']} {variant_of(key)} C={key['clip']} lr={key['lr']}{hp}"
    return f"{run} {where} seed {key['seed']}"


def print_table(k, cells, error, apart):
    """One setting's table: a row per method, a column per variant; each cell the mean ± std
    of its seeds. Two cells of one method and variant (a tuning grid) get a row each. The
    header names, besides the setting, the fields in `apart` (those that tell tables apart).
    Returns each cell's row label."""
    what = "error %" if error else "top-1 %"
    data = k["dataset"]
    if data == "imagenet_c":  # (ImageNet-R has no severity)
        data += f" severity {k['severity']}"
    others = "".join(f" | {f}={json.dumps(k.get(f), sort_keys=True)}" for f in apart)
    print(
        f"\n{data} | {k['model']} | {k['setting']} | batch {k['batch_size']}{wild(k)} | {len(k['corruptions'])} corruptions{others} | mean {what} over seeds"
    )
    entries = [(runs[0]["key"], variant_of(runs[0]["key"]), runs) for runs in cells]
    rows, labels = {}, []
    for key, variant, runs in entries:
        label = str(key["method"]).removeprefix("dp_")
        # cells of one method and variant (a tuning grid; EATA with and without its Fisher data;
        # two δ): a row each, named by what tells them apart, never one written over another
        twins = [e[0] for e in entries if e[1] == variant and e[0]["method"] == key["method"]]
        for flag in PER_CELL:
            values = {json.dumps(twin.get(flag), sort_keys=True) for twin in twins}
            if flag not in ("method", "eps", "seed") and len(values) > 1:
                label += f" {flag}={json.dumps(key.get(flag), sort_keys=True)}"
        rows.setdefault(label, {})[variant] = cell([r["mean"] for r in runs], error)
        labels.append(label)
    order = ["non-private", "clip-only", "ε=inf"] + [f"ε={e:g}" for e in TUNED_EPS]
    present = {variant for _, variant, _ in entries}
    columns = [c for c in order if c in present] + sorted(present - set(order))
    cells_and_names = [*columns, *(v for row in rows.values() for v in row.values())]
    width = max(22, *(len(text) + 2 for text in cells_and_names))  # every name apart
    print(f"{'method':<14}" + "".join(f"{c:>{width}}" for c in columns))
    for label in sorted(rows, key=method_rank):
        print(f"{label:<14}" + "".join(f"{rows[label].get(c, ''):>{width}}" for c in columns))
    return labels


def print_per_corruption(cells, labels, error):
    """Each cell's corruptions, mean ± std over its seeds, under its row's label."""
    print(f"per corruption, {'error %' if error else 'top-1 %'}:")
    for runs, label in zip(cells, labels):
        key, shown = runs[0]["key"], []
        for c in runs[0]["accuracy"]:
            seeds = [r["accuracy"][c] for r in runs if c in r["accuracy"]]
            shown.append(f"{c} {cell(seeds, error)}")
        print(f"  {label} {variant_of(key)}: " + " | ".join(shown))


# ----------------------------------------------------------------------------
# --benchmark: the cost of privacy, measured side by side
# Every filter open, every sample kept (for random weights, and the audit's canaries): H <= ln K
# always, so margins of 1.01·ln K keep all; PLPD >= −1; SAR never resets.
WIDE_OPEN = dict(
    e_margin=1.01, d_margin=math.inf, deyo_margin=1.01, plpd_threshold=-2.0, reset_ema=-math.inf
)


def benchmark(args):
    """A step of every method, non-private, clip-only and DP, timed side by side in
    interleaved rounds (the machine's drift hits every variant alike); ratio: the variant's
    step over the plain method's. --accumulate K adds rows of batches of B that step once
    per K, beside the batch of B·K."""
    check_common(args, "benchmark")
    check_out(args, "results-benchmark.jsonl")
    cuda, name, B, acc = args.device == "cuda", args.model, args.batch_size, args.accumulate
    if name is None:
        name = "vit_base_patch16_224" if cuda else "vit_small_patch16_224"
    if B is None:
        B = 64 if cuda else 32
    torch.manual_seed(args.seed)
    model = timm.create_model(name, pretrained=False).to(args.device)
    check_batchnorm(model, f"--benchmark --model {name}", "dp_ and clip", args.bn)
    config = timm.data.resolve_data_config({}, model=model)
    shape, generator = (B * acc, *config["input_size"]), torch.Generator().manual_seed(args.seed)
    x = torch.randn(shape, generator=generator).to(args.device)
    wide_open = dict(WIDE_OPEN, lr=1e-5, bn="train" if args.bn is None else args.bn)

    def fresh(method, **kwargs):  # random weights: every filter open, full steps
        return DPTTA(copy.deepcopy(model), method, **wide_open, **kwargs)

    variants = dict(source=fresh("source"))  # row -> its adapter
    for m in BASES:
        variants[m] = fresh(m)
        variants[f"{m} clip"] = fresh(m, clip=1.0)
        variants[f"dp_{m}"] = fresh(f"dp_{m}", clip=1.0, eps=5.0)
        if acc > 1:
            variants[f"dp_{m} {B}x{acc}"] = fresh(f"dp_{m}", clip=1.0, eps=5.0, accumulate=acc)

    def step(adapter):  # a window: the batch, or B at a time (accumulate)
        with autocast(args):
            for xb in x.split(len(x) // adapter.accumulate):
                adapter(xb)
        if cuda:
            torch.cuda.synchronize()

    times, peak = {row: [] for row in variants}, {}
    with warnings.catch_warnings(record=True) as caught:  # the library warns of a per-sample loop
        warnings.simplefilter("always")
        for row, adapter in variants.items():  # a warm-up; on CUDA, the peak memory
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step(adapter)
            peak[row] = torch.cuda.max_memory_allocated() / 2**20 if cuda else math.nan
        for _ in range(args.rounds):
            for row, adapter in variants.items():
                t = time.perf_counter()
                step(adapter)
                times[row].append(time.perf_counter() - t)
    loops = sorted({str(w.message).split()[0] for w in caught if "no vmap rule" in str(w.message)})
    for row, adapter in variants.items():  # a NaN would have timed NaN steps
        stop_unless_finite(adapter, f"--benchmark's {row} steps")
    n, rounds = B * acc, f"median of {args.rounds} interleaved rounds"
    print(f"benchmark | {name} | batch {n} | {args.device} | {args.dtype} | {rounds}")
    columns = f"{'variant':<16}{'ms/step':>10}{'img/s':>9}{'ratio':>8}{'peak MiB':>10}"
    print(f"{columns}   (ratio: / the plain method, an accumulate row / its dp_ row; peak: CUDA)")
    rows, ms = [], {row: 1000 * float(np.median(t)) for row, t in times.items()}
    for row, adapter in variants.items():
        plain = row.split()[0]  # an accumulate row's plain: its dp_ row
        if adapter.accumulate == 1:
            plain = plain.removeprefix("dp_")
        ratio, shown = ms[row] / ms[plain], "-" if math.isnan(peak[row]) else f"{peak[row]:.1f}"
        rows.append(dict(variant=row, ms=ms[row], images_per_s=1000 * n / ms[row], ratio=ratio))
        rows[-1]["peak_mib"] = peak[row]
        print(f"{row:<16}{ms[row]:>10.1f}{1000 * n / ms[row]:>9.1f}{ratio:>8.2f}{shown:>10}")
    print(f"vmap fallbacks: {len(loops)} (ops looping over samples; must be 0) {' '.join(loops)}")
    with tempfile.TemporaryDirectory(prefix="dptta-bench-") as tree:
        make_synthetic_tree(tree, ["gaussian_noise"], 5, 4 * B, size=375)
        transform = timm.data.create_transform(**config)
        images = WnidFolder(os.path.join(tree, "gaussian_noise", "5"), transform)
        loader = image_stream(images, B, seed=args.seed, workers=args.workers, pin_memory=cuda)
        t = time.perf_counter()
        loader_rate = sum(len(xb) for xb, _, _ in loader) / (time.perf_counter() - t)
    fastest = max(row["images_per_s"] for row in rows[1:])
    print(
        f"loader: {loader_rate:.0f} img/s (375x375 JPEG, timm transform, {args.workers} workers); the fastest step above takes {fastest:.0f} img/s"
    )
    result = dict(mode="benchmark", model=name, batch=n, device=args.device, dtype=args.dtype)
    result.update(rounds=args.rounds, rows=rows, vmap_fallbacks=len(loops))
    result.update(loader_images_per_s=loader_rate, versions={"torch": torch.__version__})
    append_jsonl(args.out, result)
    print(f"appended to {args.out}")
    return 0


# ----------------------------------------------------------------------------
# --audit: an empirical lower bound on ε from the change-one game
def epsilon_lower_bound(s_in, s_out, delta, confidence=0.95, gaussian=True):
    """ε_lb from the two worlds' scores (large: "canary in"). A threshold is chosen on half
    of the trials; its error rates on the other half are bounded by Clopper-Pearson at
    `confidence`. gaussian (Nasr et al. 2023): the ε of μ_lb-GDP, μ_lb = Φ⁻¹(1 − FPR) −
    Φ⁻¹(FNR), a Gaussian trade-off curve as the audited mechanism has; else (Kairouz et al.
    2015): log((1 − δ − FNR)/FPR) or swapped, distribution-free and much weaker."""
    s_in, s_out = np.asarray(s_in, float), np.asarray(s_out, float)
    h, alpha = min(len(s_in), len(s_out)) // 2, (1 - confidence) / 2

    def upper(errors):
        return stats.beta.ppf(1 - alpha, errors + 1, h - errors) if errors < h else 1.0

    def bound_at(t, part):
        fpr, fnr = upper((s_out[part] > t).sum()), upper((s_in[part] <= t).sum())
        if gaussian:
            return stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        with np.errstate(divide="ignore", invalid="ignore"):
            return max(0.0, *np.log(((1 - delta - fnr) / fpr, (1 - delta - fpr) / fnr)))

    # thresholds at false positive rates from 1/2 down to ~10/h; the best bounded on half 1
    cuts = np.quantile(s_out[:h], 1 - np.geomspace(0.5, min(0.5, 10 / h), 80))
    lb = bound_at(max(cuts, key=lambda t: bound_at(t, slice(0, h))), slice(h, 2 * h))
    if gaussian:
        return gdp_epsilon(sigma=2 / lb, delta=delta) if lb > 0 else 0.0
    return lb


def flat_sample_grads(adapter, x):
    """What the adapter clips, one row per sample (dp_norm: its first layer's moments)."""
    if adapter.bn_src:
        name, seen = next(iter(adapter.bn_src)), []
        bn = adapter.model.get_submodule(name)
        with torch.no_grad(), bn.register_forward_pre_hook(lambda m, inp: seen.append(inp[0])):
            adapter.model(x)
        return bn_moments(seen[0], *adapter.bn_src[name], bn.eps)
    g, _ = per_sample_grads(adapter.model, adapter.params, adapter.loss, x, adapter.context(x))
    return torch.cat([t.flatten(1).float() for t in g.values()], 1)


def craft_canaries(adapter, shape, *, steps=100, box=3.0, seed=0):
    """Two images whose per-sample gradients point apart: Adam on their pixels (within ±box)
    minimizes cos(g1, g2) − 0.01·log(‖g1‖‖g2‖) through a double backward."""
    device = next(adapter.model.parameters()).device
    images = torch.randn(2, *shape, generator=torch.Generator().manual_seed(seed)).to(device)
    opt = torch.optim.Adam([images.requires_grad_()], lr=0.05)
    theta = {n: p.detach().requires_grad_() for n, p in adapter.params.items()}
    with sdpa_kernel(SDPBackend.MATH):  # twice differentiable
        for _ in range(steps):
            ctx, g = adapter.context(images.detach()), []
            for i in range(2):
                z = logits_of(functional_call(adapter.model, theta, (images[i : i + 1],)))
                loss = adapter.loss(z, None if ctx is None else ctx[i : i + 1]).sum()
                grads = torch.autograd.grad(loss, list(theta.values()), create_graph=True)
                g.append(torch.cat([t.flatten() for t in grads]))
            cos = F.cosine_similarity(g[0], g[1], 0)
            opt.zero_grad()
            (cos - 0.01 * (g[0].norm() * g[1].norm()).log()).backward()
            opt.step()
            with torch.no_grad():
                images.clamp_(-box, box)
    return images.detach()


def audit(
    adapter,
    x,
    canary=None,
    replacement=None,
    *,
    trials=20000,
    confidence=0.95,
    seed=0,
    gaussian=True,
):
    """The change-one game on the adapter, ε_lb at `confidence`: the attacker knows all but
    the noise and scores a release along d = clip(g_in) − clip(g_out).

    White-box: the release of x's per-sample gradients (dp_norm: its first layer's v_i) and
    a canary gradient ±10·C·u, 2C apart once clipped, by clip_and_noise (no clip: C = 1,
    and the canaries stay 20 apart: no noise, no claim).
    End-to-end: θ after one real step from θ0 on x and one image or the other; each batch's
    per-sample pass runs once (adapter.replay), clip, noise and step run every trial."""
    if canary is None:
        flat = flat_sample_grads(adapter, x)
        clip = clip_of(adapter, flat.shape[1])
        size = 1.0 if math.isinf(clip) else clip
        generator = torch.Generator().manual_seed(seed)
        u = torch.randn(flat.shape[1], generator=generator).to(flat.device)
        u = 10 * size * u / u.norm()
        worlds, d = [{"θ": torch.cat([flat, s * u[None]])} for s in (1, -1)], 2 * u / u.norm()

        def release(world):
            return clip_and_noise(world, clip, adapter.sigma, adapter.noise)["θ"]

    else:
        worlds = [torch.cat([x, img[None]]) for img in (canary, replacement)]
        g = [flat_sample_grads(adapter, img[None]) for img in (canary, replacement)]
        clipped = [clip_and_noise({"θ": t}, clip_of(adapter, 1), 0.0, None)["θ"] for t in g]
        d = clipped[0] - clipped[1]

        def release(world):  # θ1 = θ0 − lr·Δ: the first momentum buffer is Δ itself
            adapter.reset()
            adapter(world)
            moved = [adapter.theta0[n] - p.detach() for n, p in adapter.params.items()]
            return torch.cat([(t / adapter.lr).flatten() for t in moved])

    adapter.replay = {}
    try:
        scores = [[release(w) for w in worlds] for _ in range(trials)]  # [trial][world]
    finally:
        adapter.replay = None
        adapter.reset()
    s_in, s_out = ((torch.stack(s).double() @ d.double()).cpu().numpy() for s in zip(*scores))
    return epsilon_lower_bound(s_in, s_out, adapter.delta, confidence, gaussian)


def clip_of(adapter, width):
    """The adapter's clip norm for rows of `width` (dp_norm: its moments'; no clip: inf)."""
    if adapter.bn_src:
        return adapter.moment_clip(width // 2)  # v_i: 2 moments per channel
    return math.inf if adapter.clip is None else adapter.clip


AUDIT_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=10)


def audit_model(norm):
    """The audit's own tiny random network: a BatchNorm CNN for dp_norm, else a ViT."""
    if norm:
        layers = [nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1)]
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8, 10))
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **AUDIT_VIT)


def audit_cli(args):
    """White-box and end-to-end ε_lb of --method at --eps, on a tiny random ViT (dp_norm: a
    BatchNorm CNN, white-box only)."""
    check_common(args, "audit")
    check_out(args, "results-audit.jsonl")
    record = METHODS[args.method]
    private, norm = record.private, record.step == "norm"
    require(args.eps is None or private, f"--eps is for dp_ methods only, not {args.method}")
    require(record.step != "none", "--audit: source releases nothing")
    # (norm's statistics are the batch's own, no release of one image: nothing to play)
    as_they_are = "--audit: norm releases the batch's statistics as they are; audit dp_norm"
    require(private or not norm, as_they_are)
    eps = 5.0 if args.eps is None and private else args.eps
    delta = 1e-6 if args.delta is None else args.delta
    kwargs = dict(eps=eps, delta=delta) if private else {}
    claim = private and math.isfinite(eps)  # the originals and ε = inf: no noise, no claim
    require(args.delta is None or claim, "--delta applies to a dp_ method with a finite --eps")
    no_step = f"{args.method} takes no --clip, --lr"
    require(not norm or (args.clip, args.lr) == (None, None), no_step)
    torch.manual_seed(args.seed)
    model = audit_model(norm)
    if not norm:
        clip = 1.0 if args.clip is None and private else args.clip
        kwargs.update(lr=0.1 if args.lr is None else args.lr, clip=clip)
        if not private:  # filters open: the canary is kept
            kwargs.update(WIDE_OPEN)
    adapter = or_fail(DPTTA, model.eval(), args.method, seed=args.seed, **kwargs)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(args.seed))
    t0 = time.time()
    lb = audit(adapter, x, trials=args.trials, seed=args.seed)
    games = {"white-box": dict(eps_lb=lb, trials=args.trials, seconds=time.time() - t0)}
    notes = {"white-box": ""}
    if not norm:  # end to end: a crafted pair, C below both gradients (both clipped)
        t0, pair = time.time(), craft_canaries(adapter, (3, 32, 32), seed=args.seed)
        if adapter.clip is not None and args.clip is None:  # well below both, whatever the shuffle
            norms = torch.cat([flat_sample_grads(adapter, pair) for _ in range(8)]).norm(dim=1)
            adapter.clip = 0.25 * norms.min().item()
        g, notes["end-to-end"] = flat_sample_grads(adapter, pair), "; no clip"
        if adapter.clip:  # g_i·min(1, C/‖g_i‖)
            g = g * (adapter.clip / g.norm(dim=1, keepdim=True)).clamp(max=1)
            apart = (g[0] - g[1]).norm() / (2 * adapter.clip)
            notes["end-to-end"] = (
                f"; the crafted pair is {apart:.2f}·2C apart, C = {adapter.clip:.3g}"
            )
        lb = audit(adapter, x, pair[0], pair[1], trials=args.e2e_trials)
        games["end-to-end"] = dict(eps_lb=lb, trials=args.e2e_trials, seconds=time.time() - t0)
    claimed = "NOT PRIVATE: no noise, no claim"
    if claim:
        claimed = f"claimed ε = {eps:g} at δ = {delta:g}, σ = {adapter.sigma:.4f}"
    print(f"audit | {args.method} | {claimed}")
    for name, game in games.items():
        n, lb = game["trials"], game["eps_lb"]
        top = epsilon_lower_bound(np.ones(n), np.zeros(n), delta)
        never_confused = top > 0 and lb >= top - 1e-9  # (at δ near 1, top and ε_lb are both 0)
        limited = f" (≥: limited by {n} trials, never confused)" if never_confused else ""
        ratio = f", ε_lb/ε = {lb / eps:.2f}" if claim else ""
        print(
            f"{name:<10}: ε_lb = {lb:.3f} at 95% confidence{limited}{ratio}; {n} trials per world, {game['seconds']:.0f} s{notes[name]}"
        )
    if not claim:
        print(f"{args.method} is not private: its releases tell the two worlds apart")
    print(
        "ε_lb via μ-GDP (Nasr et al. 2023; a Gaussian trade-off curve): above the claim shows a bug; below it proves nothing"
    )
    held = not claim or all(game["eps_lb"] <= eps for game in games.values())
    result = dict(mode="audit", method=args.method, eps=eps, delta=delta, sigma=adapter.sigma)
    result.update(private=claim, clip=adapter.clip, claim_held=held, games=games)
    append_jsonl(args.out, result)
    return int(not held)  # 1: a lower bound above the claim


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # at start-up, or a benchmark's: nothing written
        sys.exit(128 + (STOP[0] if STOP else signal.SIGINT))
