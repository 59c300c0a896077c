"""dptta: differentially private test-time adaptation (DP-TTA) in one file.

Test-time adaptation (Tent, EATA, SAR, DeYO, COME) updates the affine parameters
of a model's normalization layers on unlabeled test batches. Those updates leak
the test data. Here every update can be made private with DP-SGD's recipe:

    g_i = ∇θ ℓ(x_i)                                    one sample's own loss
    Δ   = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B   clip, sum, noise, average
    θ  ← SGD-momentum(θ, Δ)                             post-processing

What is private: each test image (the privacy unit), against replacing it by any
other image (change-one neighbours, so the sensitivity of the clipped sum is
2C). A stream shows every image once, so the whole stream is μ-GDP with μ = 2/σ
(see `gdp_delta`). Released: the adapted parameters after every step and every
prediction made for *other* images. The adapter's prediction for an image is
made before that image is used, but it is a function of the image itself and
so is returned to its owner, not released.

Quick start (no data, no GPU, random weights, about a minute):
    python dptta.py --synthetic 16 --method dp_tent --eps 5
ImageNet-C on a GPU (a header, a line per corruption, a table, a JSONL record):
    python dptta.py --data /data/ImageNet-C --method dp_deyo --eps 5
Other modes: --benchmark (cost of privacy), --audit (empirical ε lower bound),
--summarize results.jsonl (the paper's tables). As a library:
    adapter = DPTTA(model, "dp_tent", eps=5, clip=1.0, lr=1e-3)
    logits = adapter(x)   # predicts with the current θ, then takes a private step
"""
import argparse
import collections
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from functools import partial

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy import optimize, special, stats
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision.datasets import ImageFolder

# ----------------------------------------------------------------------------
# Privacy accounting: one pass, μ-GDP with μ = 2/σ


def _check_privacy(eps=None, delta=None, sigma=None):
    if eps is not None and not eps > 0:  # `not >` also catches NaN
        raise ValueError(f"eps must be > 0 (use inf for clip only, no noise), got {eps}")
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if sigma is not None and not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")


def _log_gdp_delta(eps, sigma):
    # log δ = log[Φ(a) − e^ε Φ(b)] = log Φ(a) + log(1 − e^{ε + log Φ(b) − log Φ(a)}), in log space
    # so that neither Φ underflows (large ε) nor the difference cancels (small δ).
    a = special.log_ndtr(-sigma * eps / 2 + 1 / sigma)
    b = eps + special.log_ndtr(-sigma * eps / 2 - 1 / sigma)
    return a + np.log(-np.expm1(b - a))


def gdp_delta(eps, sigma):
    """δ(ε) of the Gaussian mechanism with noise σ·C on a sum of sensitivity 2C.

    Privacy unit: one test sample. Neighbours: streams that differ by replacing
    one sample (so one clipped gradient moves by at most 2C). Such a step is
    μ-GDP with μ = 2C/(σC) = 2/σ (Dong, Roth & Su 2022, Thm 2.7), and
        δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ)      (Cor. 2.13, μ = 2/σ).
    No composition: a stream shows each sample in exactly one step; every later
    step reads it only through θ, which is post-processing of that one release
    (adaptive steps on disjoint data compose in parallel). Released: the adapted
    parameters and all predictions for other samples. NOT covered: one image
    that appears k times (the same photo under 15 corruptions): it is then
    μ√k-GDP, i.e. use sigma / √k here.
    """
    _check_privacy(eps=eps, sigma=sigma)
    if sigma == 0:
        return 1.0
    if math.isinf(eps) or math.isinf(sigma):
        return 0.0
    return float(np.exp(_log_gdp_delta(eps, sigma)))


def calibrate_sigma(eps, delta):
    """The smallest σ with gdp_delta(eps, σ) <= delta; 0.0 for eps = inf (clip only)."""
    _check_privacy(eps=eps, delta=delta)
    if math.isinf(eps):
        return 0.0
    f = lambda s: _log_gdp_delta(eps, s) - math.log(delta)  # decreasing in σ
    lo, hi = 0.1, 1.0
    while f(lo) < 0:
        lo /= 2
    while f(hi) > 0:
        hi *= 2
    sigma = optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-10)
    while f(sigma) > 0:  # brentq may stop a hair on the wrong side: never under-noise
        sigma *= 1 + 1e-10
    return float(sigma)


def gdp_epsilon(sigma, delta):
    """The smallest ε with gdp_delta(ε, sigma) <= delta; inf for σ = 0."""
    _check_privacy(delta=delta, sigma=sigma)
    if sigma == 0:
        return math.inf
    f = lambda e: _log_gdp_delta(e, sigma) - math.log(delta)  # decreasing in ε
    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
    return float(optimize.brentq(f, 0.0, hi, xtol=1e-14, rtol=1e-10))


# ----------------------------------------------------------------------------
# Per-sample gradients, clipping and noise

# LayerNorm covers timm's LayerNorm and ConvNeXt's LayerNorm2d (subclasses); _BatchNorm
# covers BatchNorm1d/2d/3d and timm's BatchNormAct2d.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def _trunk_cut(model):
    """Name of the first module of the trunk's top: ViT's last 3 blocks, the last stage of a
    staged net (ConvNeXt's `stages`), or a ResNet's last `layerN`."""
    resnet_layers = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("blocks", "stages") and isinstance(module, (nn.Sequential, nn.ModuleList)):
            top = len(module) - (3 if leaf == "blocks" else 1)
            if top > 0:
                return f"{name}.{top}"
        if re.fullmatch(r"layer\d+", leaf) and isinstance(module, nn.Sequential):
            resnet_layers.append((int(leaf[5:]), name))
    return max(resnet_layers)[1] if len(resnet_layers) > 1 else None


def adaptable_params(model, *, skip_top=False, private=True):
    """The affine parameters of the normalization layers to adapt, by name.

    skip_top=True (SAR, DeYO) keeps only the norms registered before the top of
    the trunk: ViT blocks 0..n-4 (ViT-B/16: blocks 0-8, not the final norm), for
    staged nets (ConvNeXt) the stem and every stage but the last, for ResNets
    everything before layer4.
    private=True (DP, and any per-sample clipping) refuses BatchNorm: a BN layer
    normalizes each sample with statistics of the whole batch, so one sample's
    gradient depends on the others and its clipped norm no longer bounds what it
    can change. The non-private originals adapt BN's affine parameters as Tent does.
    """
    if private:
        bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bn:
            raise ValueError(
                f"per-sample gradients (dp_ methods, clip) need samples that do not mix, but "
                f"BatchNorm ({bn[0]}, ...) mixes the samples of a batch; use a LayerNorm/GroupNorm "
                "model (ViT, ConvNeXt, ResNet-GN), or the original method without clip")
    cut, params, past_cut = _trunk_cut(model) if skip_top else None, {}, False
    for name, module in model.named_modules():
        past_cut = past_cut or name == cut
        if isinstance(module, NORMS) and not past_cut:
            for pname, p in module.named_parameters(recurse=False):
                params[f"{name}.{pname}"] = p
    if not params:
        raise ValueError("the model has no normalization-layer affine parameters to adapt")
    return params


VMAP_FALLBACKS = collections.Counter()  # op -> calls that vmap ran once per sample (should stay 0)


def per_sample_grads(model, params, loss_fn, x, ctx=None, *, chunk_size=None):
    """g_i = ∇θ loss_fn(f_θ(x_i), ctx_i) for every sample i, and the logits of that same forward.

    params: {name: tensor} to differentiate (the adapted ones); every other
    parameter and buffer is passed unbatched and frozen. loss_fn maps logits
    [N, K] (and ctx [N, ...]) to per-sample losses [N]. Returns ({name: [B, *shape]}, logits).

    How: sample i gets its own copy θ_i of the adapted parameters, and the forward
    and the loss run under vmap over (θ_i, x_i, ctx_i), so ℓ_i reads sample i alone.
    Then ONE ordinary backward of Σ_i ℓ_i: ℓ_j does not touch θ_i, so ∂(Σ_j ℓ_j)/∂θ_i = g_i
    exactly. Autograd runs outside vmap, so every backward kernel (fused attention
    included, which has no vmap rule for its backward) runs once on the whole batch;
    vmap(grad(ℓ)) would run those kernels once per sample.
    chunk_size: samples per forward/backward (None = the whole batch).
    """
    frozen = {n: t.detach() for n, t in model.named_parameters() if n not in params}
    frozen.update(model.named_buffers())

    def loss_one(theta_i, xi, ci):  # under vmap: one sample, its own θ_i
        logits = functional_call(model, (theta_i, frozen), (xi[None],))
        return loss_fn(logits, None if ci is None else ci[None])[0], logits[0]

    in_dims = (0,                            # θ_i: every sample its own copy
               0,                            # x: one image per call
               None if ctx is None else 0)   # per-sample context, e.g. DeYO's shuffled probs
    # CPU's fused attention kernel has no vmap rule even for its forward: the math backend
    # (plain matmuls and softmax) batches. CUDA's flash/efficient/cuDNN forwards do batch.
    attention = sdpa_kernel(SDPBackend.MATH) if x.device.type == "cpu" else contextlib.nullcontext()

    def batched_pass():
        grads, logits, step = [], [], chunk_size or len(x)
        for s in range(0, len(x), step):
            xs, cs = x[s:s + step], None if ctx is None else ctx[s:s + step]
            theta = {n: p.detach().expand(len(xs), *p.shape).requires_grad_() for n, p in params.items()}
            losses, z = vmap(loss_one, in_dims)(theta, xs, cs)
            grads.append(torch.autograd.grad(losses.sum(), list(theta.values()),
                                             allow_unused=True, materialize_grads=True))
            logits.append(z.detach())
        return {n: torch.cat([g[k] for g in grads]) for k, n in enumerate(params)}, torch.cat(logits)

    with attention:
        return _without_fallback(batched_pass)


def _without_fallback(fn):
    """fn() with vmap's per-sample fallback made an error; if an op needs it anyway, warn once
    per op, say what to do, count it (VMAP_FALLBACKS) and run fn() again allowing it (exact,
    slow). A caller that has disabled the fallback itself gets the error."""
    functorch = torch._C._functorch
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
    VMAP_FALLBACKS[op[1]] += 1
    if VMAP_FALLBACKS[op[1]] == 1:
        warnings.warn(f"per_sample_grads: {op[1]} has no vmap batching rule, so it runs once per "
                      "sample (exact, slow); use another op in the model, e.g. non-fused attention "
                      "(timm: fused_attn=False)", stacklevel=3)
    functorch._set_vmap_fallback_warning_enabled(False)  # said once above, not at every call
    try:
        return fn()
    finally:
        functorch._set_vmap_fallback_warning_enabled(True)


def at_least_fp32(t):
    """bf16/fp16 -> fp32 (a rounded clip factor can push a norm over C; bf16 noise is too coarse
    to be Gaussian), and fp64 stays fp64."""
    return t.double() if t.dtype == torch.float64 else t.float()


def clip_and_noise(per_sample_grads, clip, sigma, generator, tally=None):
    """Δ = (Σ_i g_i·min(1, C/‖g_i‖₂) + N(0, σ²C²I)) / B, the norm taken over all tensors jointly.

    The noise is calibrated to the *sum* (sensitivity 2C under replace-one) and
    only then divided by B: noise σC/B on a mean would be B times too small.
    Everything runs in fp32, also under bf16 autocast: a rounded clip factor can
    push a norm over C, and bf16 noise has too few bits to be Gaussian.
    A non-finite g_i counts as zero (counted in tally["nonfinite"] if given). That
    keeps the guarantee: the decision depends on sample i alone and zero has norm
    <= C, so replacing sample i still moves the sum by at most 2C. The tally is
    a fact about the data: it is not covered by the guarantee, do not publish it.
    """
    with torch.autocast(next(iter(per_sample_grads.values())).device.type, enabled=False):
        g = {n: at_least_fp32(t) for n, t in per_sample_grads.items()}
        B = next(iter(g.values())).shape[0]
        # ‖g_i‖₂ over every adapted tensor together
        norms = torch.stack([t.flatten(1).pow(2).sum(1) for t in g.values()]).sum(0).sqrt()
        finite = torch.isfinite(norms)
        # min(1, C/‖g_i‖), and 0 for a non-finite g_i
        factor = torch.where(finite, (clip / norms.clamp(min=1e-12)).clamp(max=1.0), 0.0)
        if tally is not None:
            tally["nonfinite"] = tally.get("nonfinite", 0) + (~finite).sum()
        out = {}
        for name, t in g.items():
            t = torch.where(finite.view(-1, *[1] * (t.dim() - 1)), t, 0.0)  # NaN·0 is NaN: select first
            total = (factor.view(-1, *[1] * (t.dim() - 1)) * t).sum(0)
            if sigma > 0:  # fresh noise for every tensor, N(0, σ²C²) per coordinate
                total = total + sigma * clip * torch.randn(
                    total.shape, generator=generator, device=total.device, dtype=total.dtype)
            out[name] = total / B
        return out


# ----------------------------------------------------------------------------
# Losses: per sample, logits [N, K] -> [N]; K is read from the logits


def entropy(logits):
    # H(p) = −Σ_k p_k log p_k, p = softmax(z)
    logp = at_least_fp32(logits).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def come_entropy(logits, num_classes=None):
    """COME: entropy of the Dirichlet opinion [b, u] instead of the softmax; K = num_classes,
    or the number of logits."""
    z = at_least_fp32(logits)
    # z ← z/‖z‖·stopgrad(‖z‖): same value, no gradient along z (no logit-norm inflation)
    norm = z.norm(dim=-1, keepdim=True)
    z = z / norm.clamp(min=1e-12) * norm.detach()  # clamp: all-zero logits stay 0, not NaN
    # b = e^z / (Σ e^z + K), u = K / (Σ e^z + K)  ⇔  [b, u] = softmax([z, ln K]), overflow-free
    log_k = torch.full_like(z[..., :1], math.log(num_classes or z.shape[-1]))
    q = torch.cat([z, log_k], -1).softmax(-1) + 1e-7
    # −Σ_{j=1}^{K+1} q_j log q_j
    return -(q * q.log()).sum(-1)


def plpd(logits, shuffled_probs):
    # PLPD = p(ŷ|x) − p(ŷ|x′), ŷ = argmax p(·|x): how much the prediction rests on object shape
    p = at_least_fp32(logits).softmax(-1)
    y = p.argmax(-1, keepdim=True)
    return (p.gather(-1, y) - shuffled_probs.gather(-1, y)).squeeze(-1).detach()


def confidence_weighted(logits, shuffled_probs=None, *, ent=entropy, e_margin=0.4, num_classes=None):
    """EATA: exp(E0 − H)·H; DeYO (given shuffled probs): (exp(−(H − E0)) + exp(PLPD))·H."""
    H = ent(logits)
    # w = exp(E0 − H), E0 = e_margin·ln K, a constant weight (detached)
    w = torch.exp(e_margin * math.log(num_classes or logits.shape[-1]) - H.detach())
    if shuffled_probs is not None:
        w = w + torch.exp(plpd(logits, shuffled_probs))
    return w * H


def patch_shuffle(x, grid, generator):
    """x′: each image cut into grid×grid patches, shuffled with its own permutation.

    Pixels beyond the last full patch (H or W not divisible by grid) stay in place.
    """
    B, C, H, W = x.shape
    h, w = H // grid, W // grid
    core = x[..., : h * grid, : w * grid]
    patches = core.reshape(B, C, grid, h, grid, w).permute(0, 2, 4, 1, 3, 5).reshape(B, grid * grid, C, h, w)
    perm = torch.rand(B, grid * grid, generator=generator, device=x.device).argsort(1)
    patches = patches[torch.arange(B, device=x.device)[:, None], perm]
    out = x.clone()
    out[..., : h * grid, : w * grid] = patches.reshape(B, grid, grid, C, h, w).permute(0, 3, 1, 4, 2, 5).reshape(
        B, C, h * grid, w * grid)
    return out


def fisher_information(model, params, images, n=2000):
    """EATA's F: mean over batches of (∇θ CE(f(x), argmax f(x)))², on n clean source images."""
    fisher, batches, seen = {k: torch.zeros_like(p) for k, p in params.items()}, 0, 0
    device = next(iter(params.values())).device
    p = {k: t.detach().requires_grad_() for k, t in params.items()}
    for x in images:
        x = (x[0] if isinstance(x, (list, tuple)) else x)[: n - seen].to(device)
        logits = functional_call(model, p, (x,))
        g = torch.autograd.grad(F.cross_entropy(logits, logits.argmax(1)), list(p.values()))
        for k, t in zip(p, g):
            fisher[k] += t ** 2
        batches, seen = batches + 1, seen + len(x)
        if seen >= n:
            break
    return {k: f / max(batches, 1) for k, f in fisher.items()}


# ----------------------------------------------------------------------------
# Methods and the paper's hyperparameters

BASES = ("tent", "come", "eata", "sar", "deyo", "deyo_come")
METHODS = ("source",) + BASES + tuple("dp_" + b for b in BASES)
SKIP_TOP = ("sar", "deyo", "deyo_come")  # SAR and DeYO adapt only the lower blocks

# The paper's tuned (C, lr) for ViT-B/16, batch 64, δ = 1e-6, chosen on the test stream.
PAPER_DP = {  # setting -> method -> {ε: (C, lr)}
    "continual": {
        "dp_tent": {20: (0.1, 0.1), 15: (0.1, 0.05), 10: (0.1, 0.05), 5: (1, 1e-3), 1: (0.1, 5e-3)},
        "dp_eata": {20: (1, 0.01), 15: (1, 5e-3), 10: (1, 5e-3), 5: (10, 1e-4), 1: (0.1, 5e-3)},
        "dp_sar": {20: (10, 5e-4), 15: (10, 5e-4), 10: (15, 1e-4), 5: (15, 1e-4), 1: (5, 1e-4)},
        "dp_deyo": {20: (10, 5e-5), 15: (10, 5e-5), 10: (1, 5e-4), 5: (0.1, 5e-3), 1: (0.1, 5e-3)},
        "dp_deyo_come": {20: (10, 1e-3), 15: (5, 1e-3), 10: (1, 5e-3), 5: (5, 1e-3), 1: (0.1, 5e-3)}},
    "episodic": {
        "dp_tent": {20: (1, 0.05), 15: (0.1, 0.5), 10: (0.1, 0.1), 5: (0.1, 0.1), 1: (1, 1e-3)},
        "dp_eata": {20: (10, 5e-3), 15: (0.1, 0.5), 10: (0.1, 0.5), 5: (0.1, 0.1), 1: (0.1, 0.01)},
        "dp_sar": {20: (1, 0.05), 15: (10, 1e-3), 10: (1, 0.01), 5: (0.1, 0.1), 1: (0.1, 0.01)},
        "dp_deyo": {20: (1, 0.01), 15: (1, 0.01), 10: (10, 1e-3), 5: (0.1, 0.1), 1: (0.1, 1e-3)},
        "dp_deyo_come": {20: (10, 5e-3), 15: (1, 0.05), 10: (0.1, 0.1), 5: (0.1, 0.1), 1: (0.1, 0.01)}}}
PAPER_CLIP_ONLY = {  # the original method, filters kept, per-sample clip, no noise: (C, lr)
    "continual": {"tent": (0.1, 0.5), "eata": (0.1, 0.5), "sar": (1, 0.1), "deyo": (10, 0.01), "deyo_come": (20, 0.01)},
    "episodic": {"tent": (1, 0.1), "eata": (30, 5e-3), "sar": (5, 0.05), "deyo": (35, 5e-3), "deyo_come": (20, 0.01)}}
PAPER_LR = {  # non-private originals
    "continual": {"tent": 1e-4, "eata": 5e-4, "sar": 5e-3, "deyo": 5e-4, "deyo_come": 5e-4},
    "episodic": {"tent": 1e-3, "eata": 1e-3, "sar": 5e-3, "deyo": 1e-3, "deyo_come": 1e-3}}


def paper_hparams(method, eps=math.inf, setting="continual", clip=None):
    """(C, lr, where they come from) of the paper's tables for this method, ε and setting."""
    private, base = method.startswith("dp_"), method.removeprefix("dp_")
    if base == "source":
        return None, 0.0, "no adaptation"
    table_base, note = base, ""
    if base == "come":  # the paper tunes COME only inside DeYO; Tent shares its all-norms entropy setup
        table_base, note = "tent", "; no entry for COME alone, Tent's used"
    if private and math.isinf(eps) or not private and clip is not None:
        C, lr = PAPER_CLIP_ONLY[setting][table_base]
        return C, lr, f"paper, clip-only {table_base}, {setting}{note}"
    if not private:
        return None, PAPER_LR[setting][table_base], f"paper, non-private {table_base}, {setting}{note}"
    row = PAPER_DP[setting]["dp_" + table_base]
    near = min(row, key=lambda e: abs(math.log(e / eps)))  # nearest tuned ε on a log scale
    if near != eps:
        note += f"; ε={eps:g} not tuned, nearest tuned ε={near} (log scale) used"
    C, lr = row[near]
    return C, lr, f"paper, dp_{table_base} ε={near}, {setting}{note}"


# ----------------------------------------------------------------------------
# The adapter: one step shared by every method


class DPTTA(nn.Module):
    """Wraps a model; forward(x) predicts with the current θ, then adapts θ on x.

    Methods: source; the originals tent, come, eata, sar, deyo, deyo_come (their
    data-dependent filters kept; clip=C adds per-sample clipping of each kept
    sample's own loss gradient, no noise: the paper's clip-only variants); and
    dp_<method>: (eps, delta)-DP, as in the paper: filters removed (EATA's
    redundancy filter and SAR's recovery read other samples, so whether sample i
    counts would depend on sample j, and a kept count k is itself data), weights
    moved inside the per-sample loss; eps=inf is this recipe without noise.
    Every step is SGD with momentum 0.9 on the adapted norms.
    """

    def __init__(self, model, method, *, eps=None, delta=1e-6, privacy_unit="image", repeats=1,
                 clip=None, lr=None, seed=0, setting="continual", fisher_data=None, fisher_size=2000,
                 fisher_lambda=2000.0, e_margin=0.4, d_margin=0.05, rho=0.05, reset_ema=0.2,
                 deyo_margin=0.5, plpd_threshold=0.2, patch_grid=4, num_classes=None,
                 chunk_size="auto"):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.private = method, method.startswith("dp_")
        self.kind = method.removeprefix("dp_")
        if self.private and eps is None:
            raise ValueError(f"{method} needs eps (inf = clip only, no noise)")
        if not self.private and eps is not None:
            raise ValueError(f"eps applies to the dp_ methods only, not {method}")
        if privacy_unit not in ("image", "photo"):
            raise ValueError(f"privacy_unit is 'image' or 'photo', got {privacy_unit!r}")
        if not (isinstance(repeats, int) and repeats >= 1):
            raise ValueError(f"repeats (streams each photo appears in) must be an int >= 1, got {repeats}")
        self.eps, self.delta = (eps, delta) if self.private else (None, None)
        self.privacy_unit, self.repeats = privacy_unit, repeats
        # unit "photo": each photo is in `repeats` streams, one release each; k releases of
        # (2/σ)-GDP compose to (2√k/σ)-GDP, so σ_photo = √k·σ(ε, δ) makes the photo (ε, δ)-DP
        k = repeats if privacy_unit == "photo" else 1
        self.sigma = calibrate_sigma(eps, delta) * math.sqrt(k) if self.private else 0.0
        paper_clip, paper_lr, _ = paper_hparams(method, eps if self.private else math.inf, setting, clip)
        clip = paper_clip if clip is None else clip
        self.clip, self.lr = None if clip is None else float(clip), float(paper_lr if lr is None else lr)
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 (None = no clipping, originals only), got {clip}")
        if self.kind != "source" and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.model = model.eval()  # eval: no dropout, and nothing random under vmap
        self.model.requires_grad_(False)
        if self.kind == "source":
            return
        per_sample = self.private or self.clip is not None
        self.params = adaptable_params(model, skip_top=self.kind in SKIP_TOP, private=per_sample)
        for m in model.modules():  # (originals only) Tent: BN normalizes with the test batch's own
            if isinstance(m, nn.modules.batchnorm._BatchNorm):  # statistics, no running averages
                m.train()
                m.track_running_stats = False
        for p in self.params.values():
            p.requires_grad_(True)
        self.hp = dict(e_margin=e_margin, d_margin=d_margin, rho=rho, reset_ema=reset_ema,
                       deyo_margin=deyo_margin, plpd_threshold=plpd_threshold, patch_grid=patch_grid,
                       fisher_lambda=fisher_lambda, num_classes=num_classes)
        device = next(iter(self.params.values())).device
        # the per-sample pass in chunks of 8 on CPU, where small chunks stay in cache (ViT-S/16,
        # batch 32, 2 cores: 0.96x Tent's step; 16: 1.05x; the whole batch: 1.42x); one pass on GPUs
        self.chunk_size = (8 if device.type == "cpu" else None) if chunk_size == "auto" else chunk_size
        come = self.kind in ("come", "deyo_come")
        self.ent = ent = partial(come_entropy, num_classes=num_classes) if come else entropy
        # ℓ_i(logits, ctx): the per-sample loss whose gradient is clipped, weights inside (detached)
        weighted = self.kind in ("eata", "deyo", "deyo_come")
        self.loss = partial(confidence_weighted, ent=ent, e_margin=e_margin,
                            num_classes=num_classes) if weighted else lambda z, ctx: ent(z)
        # Noise and shuffles get their own seeded streams; reset() never rewinds them:
        # reusing a noise draw on another batch would let it be subtracted out.
        self.noise_gen = torch.Generator(device).manual_seed(seed)
        self.shuffle_gen = torch.Generator(device).manual_seed(seed + 1)
        self.theta0 = {n: p.detach().clone() for n, p in self.params.items()}
        self.fisher = None
        if self.kind == "eata":
            if fisher_data is None:
                print(f"{method}: no fisher_data given, so no anti-forgetting penalty", file=sys.stderr)
            else:
                self.fisher = fisher_information(model, self.params, fisher_data, fisher_size)
        self.tally = {}
        self.reset()

    def reset(self):
        """Back to the source model: parameters, optimizer and method state (not the RNGs)."""
        if self.kind == "source":
            return
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.theta0[n])
        self.opt = torch.optim.SGD(self.params.values(), lr=self.lr, momentum=0.9)
        self.ema = None     # SAR: moving average of the loss, for recovery
        self.m = None       # EATA: moving average of kept softmax vectors
        self.g_prev = None  # DP-SAR: the previous private gradient, the ascent direction

    # -- hooks: the few places where methods differ besides ℓ_i --------------

    def _keep(self, logits, ctx, keep):
        """The original method's sample filter (None = keep all). DP variants have none."""
        if self.private or self.kind in ("tent", "come"):
            return keep
        log_k = math.log(self.hp["num_classes"] or logits.shape[-1])
        H = self.ent(logits.detach())
        if self.kind in ("deyo", "deyo_come"):
            new = (H < self.hp["deyo_margin"] * log_k) & (plpd(logits, ctx) > self.hp["plpd_threshold"])
        else:  # eata, sar: reliable samples, H < E0
            new = H < self.hp["e_margin"] * log_k
        if self.kind == "eata":  # redundancy: skip samples that look like the recent average
            p = logits.detach().float().softmax(-1)
            if self.m is not None:
                new &= F.cosine_similarity(self.m[None], p, dim=1).abs() < self.hp["d_margin"]
            if new.any():  # m ← 0.9·m + 0.1·mean(p of kept)
                mean = p[new].mean(0)
                self.m = mean if self.m is None else 0.9 * self.m + 0.1 * mean
        return new if keep is None else keep & new

    def context(self, x):
        """What ℓ_i reads besides its logits: DeYO's softmax on the patch-shuffled x′ (an extra
        forward, batched, without gradient); None for the other methods."""
        if self.kind not in ("deyo", "deyo_come"):
            return None
        with torch.no_grad():
            xs = patch_shuffle(x, self.hp["patch_grid"], self.shuffle_gen)
            return self.model(xs).float().softmax(-1)

    def _grad(self, x, ctx, shift=None, keep=None, clip=True):
        """(logits, Δ, kept) at θ + shift: Δ averages the kept samples' gradients, None if none.
        clip=False: the plain mean gradient even if the adapter clips."""
        p = {n: (t + shift[n] if shift else t).detach() for n, t in self.params.items()}
        if self.clip is None or not clip:  # plain TTA: one batched backward of the mean kept loss
            p = {n: t.requires_grad_() for n, t in p.items()}
            logits = functional_call(self.model, p, (x,))
            keep = self._keep(logits, ctx, keep)
            finite = torch.isfinite(logits).all(-1)
            z, c, use = logits, ctx, keep  # what the loss sees
            if not finite.all():  # a NaN sample would poison every gradient (0·NaN = NaN, whatever
                # its loss weight): it is dropped, counted, and the rest forwarded again without it
                self.tally["nonfinite"] = self.tally.get("nonfinite", 0) + (~finite).sum()
                keep = finite if keep is None else keep & finite
                if keep.any():
                    z = functional_call(self.model, p, (x[finite],))
                    c, use = None if ctx is None else ctx[finite], keep[finite]
            if keep is not None and not keep.any():
                return logits, None, keep
            losses = self.loss(z, c)
            if use is not None:
                losses = losses[use]
            g = torch.autograd.grad(losses.mean(), list(p.values()))
            return logits, {n: at_least_fp32(t) for n, t in zip(p, g)}, keep
        g, logits = per_sample_grads(self.model, p, self.loss, x, ctx, chunk_size=self.chunk_size)
        keep = self._keep(logits, ctx, keep)
        if keep is not None:  # originals only: the sample set (and B) is data dependent
            if not keep.any():
                return logits, None, keep
            g = {n: t[keep] for n, t in g.items()}
        return logits, clip_and_noise(g, self.clip, self.sigma, self.noise_gen, self.tally), keep

    def forward(self, x):
        if self.kind == "source":
            with torch.no_grad():
                return self.model(x)
        ctx = self.context(x)
        if self.kind == "sar" and not self.private:
            # the ascent direction from the plain mean gradient, clip-only or not (as the paper)
            logits, g, keep = self._grad(x, ctx, clip=False)
            if g is not None:  # SAM: the gradient at θ + ρ·g/‖g‖, re-filtered there, steps from θ
                shifted, g, keep = self._grad(x, ctx, self._ascent(g), keep)
            if g is not None:
                self._step(g)
                self._recover(self.ent(shifted.detach())[keep].mean())
        elif self.kind == "sar":  # DP-SAT: ascend along the previous *private* gradient (free)
            shift = None if self.g_prev is None else self._ascent(self.g_prev)
            logits, g, _ = self._grad(x, ctx, shift)
            if shift is not None:  # predict with θ itself, not θ + shift
                with torch.no_grad():
                    logits = self.model(x)
            self.g_prev = g
            self._step(g)
        else:
            logits, g, _ = self._grad(x, ctx)
            if g is not None:  # a batch in which no sample survives the filters makes no step
                self._step(g)
        return logits.detach()

    def _ascent(self, g):
        # ε = ρ·g/‖g‖
        norm = torch.stack([t.pow(2).sum() for t in g.values()]).sum().sqrt()
        return {n: self.hp["rho"] * t / norm.clamp(min=1e-12) for n, t in g.items()}

    def _step(self, g):
        if self.fisher is not None:  # data-free: θ, θ0 and F from public data, so outside the clip
            for n in g:  # ∇ λ·Σ F(θ − θ0)² = 2λF(θ − θ0)
                g[n] = g[n] + 2 * self.hp["fisher_lambda"] * self.fisher[n] * (self.params[n].detach() - self.theta0[n])
        for n, p in self.params.items():
            p.grad = g[n].to(p.dtype)
        self.opt.step()

    def _recover(self, loss):
        # SAR: ema ← 0.9·ema + 0.1·loss; a collapse (ema < reset_ema) resets model AND optimizer
        loss = loss.item()
        if not math.isnan(loss):
            self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if self.ema is not None and self.ema < self.hp["reset_ema"]:
            self.reset()


# ----------------------------------------------------------------------------
# Audit: an empirical lower bound on ε from a distinguishing game


def epsilon_lower_bound(s_in, s_out, delta, confidence=0.95, gaussian=True):
    """ε_lb from test statistics of the two neighbouring worlds (large = "canary in").

    A threshold chosen on the first half of the trials is applied to the
    second half, and its false positive and false negative rates get
    Clopper-Pearson upper bounds (each at (1 − confidence)/2).
    gaussian=True (Nasr et al. 2023): the bounds give μ_lb = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR),
    a lower bound on μ if the trade-off curve is Gaussian, as it is for the
    mechanism audited here; then ε_lb = ε of μ_lb-GDP at δ. Strong at any ε.
    gaussian=False (Kairouz et al. 2015), distribution-free but weak:
    ε_lb = log((1 − δ − FNR)/FPR), and likewise with the roles swapped.
    """
    s_in, s_out = np.asarray(s_in, float), np.asarray(s_out, float)
    h, alpha = min(len(s_in), len(s_out)) // 2, (1 - confidence) / 2

    def bound(fp, fn):
        fpr = stats.beta.ppf(1 - alpha, fp + 1, h - fp) if fp < h else 1.0  # Clopper-Pearson upper bounds
        fnr = stats.beta.ppf(1 - alpha, fn + 1, h - fn) if fn < h else 1.0
        if gaussian:  # μ_lb of the Gaussian trade-off curve through (FPR, FNR)
            return stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        with np.errstate(divide="ignore", invalid="ignore"):
            return max(0.0, np.log((1 - delta - fnr) / fpr), np.log((1 - delta - fpr) / fnr))

    # thresholds at false positive rates from 1/2 down to ~10/h; pick the best *bounded* one on half 1
    cuts = np.quantile(s_out[:h], 1 - np.geomspace(0.5, min(0.5, 10 / h), 80))
    best = max(cuts, key=lambda t: bound((s_out[:h] > t).sum(), (s_in[:h] <= t).sum()))
    lb = bound((s_out[h:2 * h] > best).sum(), (s_in[h:2 * h] <= best).sum())
    if not gaussian:
        return lb
    return gdp_epsilon(2 / lb, delta) if lb > 0 else 0.0  # μ = 2/σ


def flat_sample_grads(adapter, x):
    """The adapter's per-sample gradients at θ, one row per sample: the joint clip's view."""
    g = per_sample_grads(adapter.model, adapter.params, adapter.loss, x, adapter.context(x))[0]
    return torch.cat([t.flatten(1).float() for t in g.values()], 1)


def audit(adapter, x, canary=None, replacement=None, *, trials=20000, confidence=0.95, seed=0, gaussian=True):
    """Play the change-one game against a private adapter; return ε_lb at `confidence`.

    The worlds differ in one sample of the batch x. The attacker knows all but
    the noise and tests the release along d = clip(g_in) − clip(g_out), the
    optimal direction for the Gaussian mechanism.
    White-box (no images given): the release is clip_and_noise itself, on the
    method's per-sample gradients of x (flattened into one tensor: the same
    joint clip) plus a canary *gradient* of norm 10·C, or its negative: the two
    clipped gradients are 2C apart, the worst case the analysis covers.
    End-to-end (canary and replacement images): a real DPTTA step from θ0 on
    x + image, and the attacker sees only the adapted parameters.
    """
    a = adapter
    if canary is None:
        flat = flat_sample_grads(a, x)
        u = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(seed)).to(flat.device)
        u = 10 * a.clip * u / u.norm()
        worlds = [{"θ": torch.cat([flat, s * u[None]])} for s in (1, -1)]
        d = 2 * a.clip * u / u.norm()
    else:
        worlds = [torch.cat([x, img[None]]) for img in (canary, replacement)]
        d = torch.sub(*(clip_and_noise({"θ": flat_sample_grads(a, img[None])}, a.clip, 0.0, None)["θ"]
                        for img in (canary, replacement)))
    scores = [[], []]
    for _ in range(trials):
        for i, w in enumerate(worlds):
            if canary is None:
                release = clip_and_noise(w, a.clip, a.sigma, a.noise_gen)["θ"]
            else:
                a.reset()
                a(w)  # θ1 = θ0 − lr·Δ: the first step's momentum buffer is Δ itself
                release = torch.cat([((a.theta0[n] - p.detach()) / a.lr).flatten() for n, p in a.params.items()])
            scores[i].append(release)
    a.reset()
    s_in, s_out = ((torch.stack(s).double() @ d.double()).cpu().numpy() for s in scores)
    return epsilon_lower_bound(s_in, s_out, a.delta, confidence, gaussian)


# ----------------------------------------------------------------------------
# Data: ImageNet-C / ImageNet-R folders, labelled by WordNet id

CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
               "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
               "jpeg_compression")
HELD_OUT = ("speckle_noise", "gaussian_blur", "spatter", "saturate")  # for choosing hyperparameters
LAYOUT = ("expected ROOT/<corruption>/<severity>/<wnid>/*.JPEG (ImageNet-R: ROOT/<wnid>/*.jpg); "
          "ImageNet-C is at https://zenodo.org/record/2235448")


class WnidFolder(ImageFolder):
    """ImageFolder whose targets are ImageNet-1k indices found by WordNet id, never by
    enumeration (a tree with a subset of classes still scores right), and that yields
    None for an unreadable image instead of ending a run hours in."""

    def __init__(self, root, transform):
        super().__init__(root, transform)
        index = {w: i for i, w in enumerate(timm.data.ImageNetInfo().label_names())}
        unknown = [c for c in self.classes if c not in index]
        if unknown:
            raise ValueError(f"{root}: {unknown[0]} is not an ImageNet-1k WordNet id; {LAYOUT}")
        self.imagenet_index = [index[c] for c in self.classes]

    def __getitem__(self, i):
        path, c = self.samples[i]
        try:
            return self.transform(self.loader(path)), self.imagenet_index[c]
        except (OSError, ValueError, SyntaxError):  # PIL: truncated, corrupt, not an image
            return None


def collate_skipping(batch):
    """(x, y, unreadable): an unreadable image becomes a gray placeholder labelled −1. It is
    not scored, but it still counts in B: the divisor never depends on whether a file could
    be read, and the placeholder is just another image, clipped like any (change-one)."""
    good = [b for b in batch if b is not None]
    if not good:
        return None, None, len(batch)
    blank = (torch.zeros_like(good[0][0]), -1)
    x, y = default_collate([blank if b is None else b for b in batch])
    return x, y, len(batch) - len(good)


def image_stream(folder, transform, args, limit=None):
    """A DataLoader over a seeded shuffle of the folder's images, the first `limit` only."""
    ds = WnidFolder(folder, transform)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed))[:limit].tolist()
    return DataLoader(Subset(ds, order), args.batch_size, num_workers=args.workers, collate_fn=collate_skipping,
                      pin_memory=args.device == "cuda", persistent_workers=args.workers > 0)


class ClassSubset(nn.Module):
    """A 1000-way model scored on some classes only (ImageNet-R: its 200)."""

    def __init__(self, model, classes):
        super().__init__()
        self.model = model
        self.register_buffer("classes", torch.as_tensor(classes))

    def forward(self, x):
        return self.model(x)[:, self.classes]


def make_synthetic_tree(root, corruptions, severity, n, size=64, seed=0):
    """An ImageNet-C-shaped tree of random JPEGs: n per corruption over 10 real wnids."""
    wnids, rng = timm.data.ImageNetInfo().label_names()[:10], np.random.default_rng(seed)
    for c in corruptions:
        for i in range(n):
            d = os.path.join(root, c, str(severity), wnids[i % len(wnids)])
            os.makedirs(d, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(d, f"{i:06d}.JPEG"), quality=90)
    return root


# ----------------------------------------------------------------------------
# main: stream the test set through the adapter

DEFAULT_MODEL = "vit_base_patch16_224.augreg2_in21k_ft_in1k"


def fail(msg):
    """A bad input: one line on stderr, exit code 2, no traceback."""
    print(f"dptta: error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Differentially private test-time adaptation on ImageNet-C/-R.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.error = fail  # argparse's own complaints become one line and exit 2 too
    a = ap.add_argument
    a("--method", default="dp_tent", choices=METHODS, help="source, an original TTA method, or its dp_ variant")
    a("--eps", type=float, default=None, help="dp_ methods: ε per test image, inf = clip only (default 5)")
    a("--delta", type=float, default=1e-6, help="dp_ methods: δ")
    a("--clip", type=float, default=None, help="per-sample clip norm C; on an original = its clip-only variant "
                                               "(default: the paper's C for dp_ methods, none for originals)")
    a("--lr", type=float, default=None, help="SGD learning rate, momentum 0.9 (default: the paper's)")
    a("--batch-size", type=int, default=None, help="test batch (default 64; --benchmark on CPU: 32)")
    a("--setting", default="continual", choices=("continual", "episodic"),
      help="continual: one model through every corruption; episodic: reset model and optimizer before each")
    a("--data", default=os.environ.get("IMAGENET_C"), help="dataset root (default: $IMAGENET_C)")
    a("--dataset", default="imagenet_c", choices=("imagenet_c", "imagenet_r"), help="folder layout and label space")
    a("--severity", type=int, default=5, help="ImageNet-C severity, 1-5")
    a("--corruptions", default=",".join(CORRUPTIONS), help="comma-separated, streamed in this order")
    a("--model", default=None, help=f"timm model name (default {DEFAULT_MODEL}; --benchmark on CPU: "
                                    "vit_small_patch16_224)")
    a("--checkpoint", default=None, help="local weights for --model (offline clusters); no download")
    a("--fisher-data", default=None, help="EATA: clean source images (ImageNet val, <wnid>/ folders) for the Fisher")
    a("--seed", type=int, default=0, help="data order, noise and patch shuffles")
    a("--workers", type=int, default=min(8, os.cpu_count() or 1), help="DataLoader worker processes")
    a("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto = cuda if available, else cpu")
    a("--amp", default="bf16", choices=("bf16", "off"), help="bf16 autocast for forward/backward on CUDA")
    a("--limit", type=int, default=None, help="images per corruption, for quick looks")
    a("--log-every", type=int, default=100, help="a progress line every N batches")
    a("--out", default="results.jsonl", help="one JSON line per run is appended here")
    a("--resume", action="store_true", help="skip the run if --out already holds one with the same settings")
    a("--synthetic", type=int, default=None, metavar="N",
      help="smoke run: N random images per corruption in a generated tree, random weights (chance accuracy)")
    a("--summarize", default=None, metavar="JSONL", help="print the paper-style tables of a results file")
    a("--benchmark", action="store_true", help="time one step of every method: non-private, clip-only, DP")
    a("--audit", action="store_true", help="empirical ε lower bound of --method at --eps on a small model")
    a("--rounds", type=int, default=5, help="--benchmark: timed rounds (median reported)")
    a("--trials", type=int, default=20000, help="--audit: trials per world")
    return ap.parse_args(argv)


def stream_folder(args, corruption):
    return args.data if args.dataset == "imagenet_r" else os.path.join(args.data, corruption, str(args.severity))


def check_args(args):
    """Validate and fill in defaults; every complaint is one line and exit 2."""
    private = args.method.startswith("dp_")
    if args.eps is not None and not private:
        fail(f"--eps applies to dp_ methods only; {args.method} is not private (try dp_{args.method})")
    if private and args.eps is None:
        args.eps = 5.0
    for name, v, ok, what in [("eps", args.eps, lambda v: v > 0, "> 0 (inf = clip only)"),
                              ("delta", args.delta, lambda v: 0 < v < 1, "in (0, 1)"),
                              ("clip", args.clip, lambda v: v > 0, "> 0"), ("lr", args.lr, lambda v: v > 0, "> 0"),
                              ("batch-size", args.batch_size, lambda v: v >= 1, ">= 1"),
                              ("limit", args.limit, lambda v: v >= 1, ">= 1"),
                              ("severity", args.severity, lambda v: 1 <= v <= 5, "in 1..5")]:
        if v is not None and not ok(v):
            fail(f"--{name} must be {what}, got {v}")
    args.batch_size = args.batch_size or 64
    args.model = args.model or DEFAULT_MODEL
    args.corruptions = [c for c in args.corruptions.split(",") if c]
    for c in args.corruptions:
        if c not in CORRUPTIONS + HELD_OUT:
            fail(f"unknown corruption {c!r}; choose from {', '.join(CORRUPTIONS + HELD_OUT)}")
    if args.dataset == "imagenet_r":
        args.corruptions = ["imagenet_r"]
    if args.synthetic is not None:
        if args.synthetic < 1:
            fail(f"--synthetic must be >= 1, got {args.synthetic}")
        if args.corruptions == list(CORRUPTIONS):  # keep a smoke run short
            args.corruptions = args.corruptions[:3]
        args.data = make_synthetic_tree(tempfile.mkdtemp(prefix="dptta-synthetic-"), args.corruptions,
                                        args.severity, args.synthetic)
    if not args.data:
        fail(f"no data root: pass --data or set $IMAGENET_C; {LAYOUT}")
    if not os.path.isdir(args.data):
        fail(f"--data {args.data} is not a folder; {LAYOUT}")
    for c in args.corruptions:
        folder = stream_folder(args, c)
        if not os.path.isdir(folder):
            fail(f"missing {folder}; {LAYOUT}")
    for flag, path in (("checkpoint", args.checkpoint), ("fisher-data", args.fisher_data)):
        if path and not os.path.exists(path):
            fail(f"--{flag} {path} does not exist")
    args.device = pick_device(args.device)
    return args


def pick_device(name):
    """auto = cuda if one is visible, else cpu: decided here only."""
    if name == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but no CUDA device is visible")
    return name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def build_model(args):
    try:
        model = timm.create_model(args.model, pretrained=not (args.synthetic or args.checkpoint))
    except Exception as e:  # unknown name, no network for the weights, ...
        fail(f"cannot build {args.model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
             " (offline? pass --checkpoint PATH)")
    if args.checkpoint:
        try:
            timm.models.load_checkpoint(model, args.checkpoint)
        except Exception as e:  # wrong keys or shapes, not a checkpoint at all
            fail(f"checkpoint {args.checkpoint} does not fit {args.model}: {str(e).splitlines()[0][:300]}")
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    return model, transform


def privacy_ledger(adapter, repeats):
    """What is promised, to whom, in numbers."""
    if not adapter.private:
        return {"private": False, "clip": adapter.clip}
    s, d = adapter.sigma, adapter.delta
    return {"private": True, "eps": adapter.eps, "delta": d, "sigma": s, "mu": 2 / s if s else math.inf,
            "clip": adapter.clip, "unit": "one test image, replace-one neighbours, used in one step",
            "repeats": repeats,  # the same underlying image in `repeats` streams: μ√k, i.e. σ/√k
            "eps_per_underlying_image": gdp_epsilon(s / math.sqrt(repeats), d) if s else math.inf}


def append_jsonl(path, record):
    # one write() on an O_APPEND descriptor: parallel runs never interleave their lines
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def run_key(args):
    return {k: getattr(args, k) for k in ("method", "eps", "delta", "clip", "lr", "batch_size", "setting",
                                          "dataset", "severity", "corruptions", "model", "seed", "limit")}


def summarize(path):
    """The paper's table: rows = methods, columns = non-private, clip-only, ε = 20 ... 1; mean ± std over seeds."""
    if not os.path.exists(path):
        fail(f"--summarize {path} does not exist")
    with open(path) as f:
        runs = [r for r in map(json.loads, filter(str.strip, f)) if r.get("mode") == "adapt"]
    tables = {}
    for r in runs:
        s = r["settings"]
        private = r["method"].startswith("dp_")
        col = ("ε=inf" if math.isinf(r["eps"]) else f"ε={r['eps']:g}") if private else \
              ("clip-only" if r["clip"] else "non-private")
        table = tables.setdefault((s["dataset"], s["model"], r["setting"], s["severity"]), {})
        table.setdefault(r["method"].removeprefix("dp_"), {}).setdefault(col, []).append(r["mean"])
    for (dataset, model, setting, severity), table in tables.items():
        cols = ["non-private", "clip-only", "ε=inf"] + [f"ε={e:g}" for e in (20, 15, 10, 5, 1)]
        extra = sorted({c for row in table.values() for c in row} - set(cols))
        cols = [c for c in cols + extra if any(c in row for row in table.values())]
        print(f"\n{dataset} severity {severity} | {model} | {setting} | mean top-1 % over seeds")
        print(f"{'method':<12}" + "".join(f"{c:>16}" for c in cols))
        for method in [m for m in ("source",) + BASES if m in table]:
            cells = [table[method].get(c) for c in cols]
            print(f"{method:<12}" + "".join(
                f"{'':>16}" if v is None else f"{np.mean(v):>9.1f} ± {np.std(v):<4.1f}" for v in cells))
    return 0


def _rss_mib(field, reset=False):
    """Linux: the process's RSS ("VmRSS") or its peak ("VmHWM") in MiB, NaN elsewhere. reset: hand
    freed memory back (glibc keeps it), then restart the peak from the current RSS ("5")."""
    try:
        if reset:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2 ** 10
    except (OSError, StopIteration):
        return math.nan


def benchmark(args):
    """One step of every method, non-private / clip-only / DP, timed side by side."""
    device = torch.device(pick_device(args.device))
    amp = args.amp == "bf16" and device.type == "cuda"
    name = args.model or ("vit_base_patch16_224" if device.type == "cuda" else "vit_small_patch16_224")
    B = args.batch_size or (64 if device.type == "cuda" else 32)
    rounds = args.rounds
    torch.manual_seed(args.seed)
    model = timm.create_model(name, pretrained=False).to(device)
    data_config = timm.data.resolve_data_config({}, model=model)
    x = torch.randn(B, *data_config["input_size"], generator=torch.Generator().manual_seed(args.seed)).to(device)
    variants = {"source": DPTTA(model, "source")}
    for b in BASES:
        variants[b] = DPTTA(model, b, lr=1e-5)
        variants[b + " clip"] = DPTTA(model, b, lr=1e-5, clip=1.0)
        variants["dp_" + b] = DPTTA(model, "dp_" + b, lr=1e-5, clip=1.0, eps=5.0)
    for a in variants.values():  # random weights: open every filter so that each step is a full one
        if a.kind != "source":
            a.hp.update(e_margin=math.inf, d_margin=math.inf, deyo_margin=math.inf, plpd_threshold=-math.inf,
                        reset_ema=-math.inf)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, peak, fallbacks_before = {k: [] for k in variants}, {}, sum(VMAP_FALLBACKS.values())
    for k, a in variants.items():  # warm-up, and the step's peak memory: CUDA allocated, or RSS
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            rss = _rss_mib("VmRSS", reset=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            a(x)
        sync()
        peak[k] = (torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else
                   _rss_mib("VmHWM") - rss)
    for r in range(rounds):  # interleaved: drift of the machine hits every variant alike
        for k, a in variants.items():
            t = time.perf_counter()
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                a(x)
            sync()
            times[k].append(time.perf_counter() - t)
    rows = []
    print(f"benchmark | {name} | batch {B} | {device.type} | {'bf16' if amp else 'fp32'} | median of {rounds} "
          f"interleaved rounds")
    print(f"{'variant':<16}{'ms/step':>10}{'img/s':>9}{'ratio':>8}{'peak MiB':>10}{'per-sample g MiB':>18}"
          f"   (peak: {'CUDA max allocated' if device.type == 'cuda' else 'RSS growth during one step'})")
    for k, a in variants.items():
        ms = 1000 * float(np.median(times[k]))
        base = 1000 * float(np.median(times[k.split()[0].removeprefix("dp_")]))
        psg = 0.0 if a.kind == "source" or a.clip is None else \
            B * sum(p.numel() for p in a.params.values()) * 4 / 2 ** 20
        rows.append({"variant": k, "ms": ms, "images_per_s": 1000 * B / ms, "ratio": ms / base,
                     "peak_mib": peak[k], "per_sample_grad_mib": psg})
        print(f"{k:<16}{ms:>10.1f}{1000 * B / ms:>9.1f}{ms / base:>8.2f}{peak[k]:>10.1f}{psg:>18.2f}")
    tree = make_synthetic_tree(tempfile.mkdtemp(prefix="dptta-bench-"), ["gaussian_noise"], 5, 4 * B, size=375)
    transform = timm.data.create_transform(**data_config)
    args.batch_size, args.device = B, device.type
    loader = image_stream(os.path.join(tree, "gaussian_noise", "5"), transform, args)
    t, n = time.perf_counter(), 0
    for xb, _, _ in loader:
        n += len(xb)
    loader_rate = n / (time.perf_counter() - t)
    shutil.rmtree(tree, ignore_errors=True)
    fallbacks = sum(VMAP_FALLBACKS.values()) - fallbacks_before
    print(f"vmap fallbacks: {fallbacks} (per-sample passes that ran an op once per sample; must be 0)"
          + (f": {', '.join(VMAP_FALLBACKS)}" if fallbacks else ""))
    print(f"loader: {loader_rate:.0f} img/s (375x375 JPEG decode + timm transform, {args.workers} workers); "
          f"the slowest step above needs {max(r['images_per_s'] for r in rows[1:]):.0f} img/s at most")
    append_jsonl(args.out, {"mode": "benchmark", "model": name, "batch": B, "device": device.type,
                            "dtype": "bf16" if amp else "fp32", "rounds": rounds, "rows": rows,
                            "loader_images_per_s": loader_rate, "vmap_fallbacks": fallbacks, "versions": {"torch": torch.__version__}})
    return 0


def audit_cli(args):
    """--audit: white-box and end-to-end ε lower bounds for --method at --eps on a small ViT."""
    if not args.method.startswith("dp_"):
        fail(f"--audit needs a dp_ method, not {args.method}")
    eps = 5.0 if args.eps is None else args.eps
    if not (eps > 0 and not math.isinf(eps)):
        fail(f"--audit needs a finite --eps > 0, got {eps}")
    torch.manual_seed(args.seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, num_classes=10)
    a = DPTTA(model, args.method, eps=eps, delta=args.delta, clip=args.clip or 1.0, lr=args.lr or 0.1,
              seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(4, 3, 32, 32, generator=g)
    white = audit(a, x, trials=args.trials, seed=args.seed)
    # end to end the canary is an image: to make the game strong, C sits below every candidate's
    # gradient norm (both worlds clip) and the replacement is the candidate pointing furthest away
    cands = 3 * torch.randn(16, 3, 32, 32, generator=g)
    flat = flat_sample_grads(a, cands)
    norms = flat.norm(dim=1)
    a.clip = args.clip or 0.5 * norms.min().item()
    far = int((flat[1:] @ flat[0] / norms[1:]).argmin()) + 1
    e2e_trials = max(args.trials // 10, 100)
    e2e = audit(a, x, cands[0], cands[far], trials=e2e_trials)
    # images cannot be made exactly opposite: the worlds are ‖clip(g_in) − clip(g_out)‖ = frac·2C apart,
    # and no attack on this pair can show more than the ε of (frac·μ)-GDP
    clipped = [clip_and_noise({"θ": flat[i:i + 1]}, a.clip, 0.0, None)["θ"] for i in (0, far)]
    frac = ((clipped[0] - clipped[1]).norm() / (2 * a.clip)).item()
    reach = gdp_epsilon(a.sigma / frac, args.delta) if a.sigma else math.inf
    print(f"audit | {args.method} | claimed ε = {eps:g} at δ = {args.delta:g} | σ = {a.sigma:.4f} | "
          f"end-to-end C = {a.clip:.3g}")
    print(f"white-box  : ε_lb = {white:.3f} at 95% confidence, {args.trials} trials per world, "
          f"ε_lb/ε = {white / eps:.2f}")
    print(f"end-to-end : ε_lb = {e2e:.3f} at 95% confidence, {e2e_trials} trials per world, "
          f"ε_lb/ε = {e2e / eps:.2f}; the image pair is {frac:.2f}·2C apart, so at most ε = {reach:.3f} shows")
    print("ε_lb via μ-GDP (Nasr et al. 2023): assumes a Gaussian trade-off curve, as the audited mechanism has. "
          "A lower bound: exceeding the claim shows a bug; staying below it proves nothing")
    return 0 if white <= eps and e2e <= eps else 1


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    if args.benchmark:
        return benchmark(args)
    if args.audit:
        return audit_cli(args)
    args = check_args(args)
    device = torch.device(args.device)
    amp = args.amp == "bf16" and device.type == "cuda"  # bf16 autocast on CPU is slow and inexact: off
    private = args.method.startswith("dp_")
    C, lr, source = paper_hparams(args.method, args.eps if private else math.inf, args.setting, args.clip)
    hp_note = {"clip": "given" if args.clip is not None else source, "lr": "given" if args.lr is not None else source}
    args.clip = args.clip if args.clip is not None else C
    args.lr = args.lr if args.lr is not None else lr
    if args.resume and os.path.exists(args.out):
        key = json.loads(json.dumps(run_key(args)))  # as it reads back from JSON (lists, not tuples)
        with open(args.out) as f:
            if any(json.loads(line).get("key") == key for line in f if line.strip()):
                print(f"already in {args.out}: {args.method} eps={args.eps} seed={args.seed} {args.setting}; skipped")
                return 0
    model, transform = build_model(args)
    lookup = None
    if args.dataset == "imagenet_r":  # score the 1000-way head on the classes present, found by wnid
        classes = sorted(set(WnidFolder(args.data, transform).imagenet_index))
        model = ClassSubset(model, classes)
        lookup = torch.full((1000,), -1, dtype=torch.long)
        lookup[classes] = torch.arange(len(classes))
        lookup = lookup.to(device)
    model = model.to(device)
    if device.type == "cuda" and not hasattr(model, "blocks"):  # convolutional trunks like channels_last
        model = model.to(memory_format=torch.channels_last)
    fisher = None
    if args.fisher_data and args.method.removeprefix("dp_") != "eata":
        print(f"note: --fisher-data is used by eata and dp_eata only, not {args.method}")
    elif args.fisher_data:
        loader = image_stream(args.fisher_data, transform, args)
        fisher = (x.to(device) for x, _, _ in loader if x is not None)
    try:
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            adapter = DPTTA(model, args.method, eps=args.eps if private else None, delta=args.delta,
                            clip=args.clip, lr=args.lr, seed=args.seed, setting=args.setting, fisher_data=fisher)
    except ValueError as e:
        fail(str(e))
    ledger = privacy_ledger(adapter, len(args.corruptions))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"dptta | {args.method} | {args.model} | {device.type} ({name}) | {'bf16 autocast' if amp else 'fp32'}")
    if args.synthetic:
        print(f"SMOKE RUN: {args.synthetic} random images per corruption, random weights: accuracy is chance")
    print(f"data: {args.data} | {args.dataset} severity {args.severity} | {len(args.corruptions)} stream(s) | "
          f"{args.setting} | batch {args.batch_size} | seed {args.seed}")
    if private:
        print(f"privacy: ({args.eps:g}, {args.delta:g})-DP per test image: σ = {adapter.sigma:.4f}, "
              f"μ = 2/σ = {ledger['mu']:.4f}-GDP, C = {adapter.clip:g} [{hp_note['clip']}]")
        print(f"  unit: {ledger['unit']}; released: adapted θ and every prediction for other images")
        print(f"  one image in all {len(args.corruptions)} streams (e.g. ImageNet-C's): μ√k = "
              f"{ledger['mu'] * math.sqrt(len(args.corruptions)):.3f} -> ε = {ledger['eps_per_underlying_image']:.3g}")
    elif args.method != "source":
        print(f"not private; per-sample clip C = {adapter.clip} [{hp_note['clip']}]" if adapter.clip
              else "not private; no clipping")
    if args.method != "source":
        n = sum(p.numel() for p in adapter.params.values())
        print(f"lr {adapter.lr:g} [{hp_note['lr']}] | SGD momentum 0.9 | adapting {len(adapter.params)} tensors, "
              f"{n:,} scalars")

    accuracy, drift, images, skipped, start = {}, {}, 0, 0, time.time()
    for c in args.corruptions:
        if args.setting == "episodic":
            adapter.reset()
        loader = image_stream(stream_folder(args, c), transform, args, args.limit)
        correct, seen, bad, t0 = torch.zeros((), dtype=torch.long, device=device), 0, 0, time.time()
        for i, (x, y, n_bad) in enumerate(loader):
            bad += n_bad
            if x is None:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if lookup is not None:  # ImageNet-1k index -> position among the classes scored
                y = torch.where(y >= 0, lookup[y.clamp(min=0)], y)
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                logits = adapter(x)
            correct += (logits.argmax(1) == y).sum()  # stays on the device: no sync per step
            seen += len(y) - n_bad  # placeholders (y = −1) never match and are not counted
            if (i + 1) % args.log_every == 0:
                print(f"  {c} {seen}/{len(loader.dataset)} top-1 {100 * correct.item() / seen:.1f}% "
                      f"{seen / (time.time() - t0):.0f} img/s", flush=True)
        accuracy[c] = 100 * correct.item() / max(seen, 1)
        images, skipped = images + seen, skipped + bad
        if args.method != "source":  # ‖θ − θ0‖: how far adaptation has moved (a function of θ: public)
            drift[c] = math.sqrt(sum((p.detach() - adapter.theta0[n]).pow(2).sum().item()
                                     for n, p in adapter.params.items()))
        note = f" | {bad} unreadable image(s) skipped" if bad else ""
        print(f"{c:<18} top-1 {accuracy[c]:5.1f}% | {seen} images | {seen / (time.time() - t0):.0f} img/s | "
              f"‖θ−θ0‖ {drift.get(c, 0.0):.4f}{note}", flush=True)
    wall = time.time() - start
    mean = sum(accuracy.values()) / len(accuracy)
    print("\n" + " | ".join(f"{c[:8]:>8}" for c in accuracy) + " |     mean")
    print(" | ".join(f"{a:8.1f}" for a in accuracy.values()) + f" | {mean:8.1f}")
    if skipped:
        print(f"{skipped} unreadable image(s) skipped in all")
    append_jsonl(args.out, {
        "mode": "adapt", "key": run_key(args), "settings": {k: v for k, v in vars(args).items()},
        "method": args.method, "eps": args.eps, "clip": adapter.clip, "lr": adapter.lr, "setting": args.setting,
        "seed": args.seed, "hparam_source": hp_note, "smoke": bool(args.synthetic), "device": name,
        "dtype": "bf16" if amp else "fp32", "versions": {"torch": torch.__version__, "timm": timm.__version__},
        "ledger": ledger, "accuracy": accuracy, "drift": drift, "mean": mean, "images": images, "skipped": skipped,
        "images_per_s": images / wall, "wall_s": wall, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(f"mean top-1 {mean:.2f}% | {images / wall:.0f} img/s | {wall:.0f} s | appended to {args.out}")
    if args.synthetic:
        shutil.rmtree(args.data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
