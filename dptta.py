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
    python dptta.py --synthetic 32 --method dp_tent --eps 5
ImageNet-C on a GPU (a header, a line per corruption, a table, a JSONL record):
    python dptta.py --data /data/ImageNet-C --method dp_deyo --eps 5
Other modes: --benchmark (cost of privacy), --audit (empirical ε lower bound),
--summarize results.jsonl (the paper's tables). As a library:
    adapter = DPTTA(model, "dp_tent", eps=5, clip=1.0, lr=1e-3)
    logits = adapter(x)   # predicts with the current θ, then takes a private step
"""
import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import optimize, special, stats
from torch.func import functional_call, grad, vmap

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

# LayerNorm covers timm's LayerNorm and ConvNeXt's LayerNorm2d (subclasses).
NORMS = (nn.LayerNorm, nn.GroupNorm)


def _trunk_cut(model):
    """Name of the first module of the trunk's top: the last 3 ViT blocks or the last stage."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("blocks", "stages") and isinstance(module, (nn.Sequential, nn.ModuleList)):
            top = len(module) - (3 if leaf == "blocks" else 1)
            if top > 0:
                return f"{name}.{top}"
    return None


def adaptable_params(model, *, skip_top=False, private=True):
    """The affine parameters of the LayerNorm/GroupNorm layers to adapt, by name.

    skip_top=True (SAR, DeYO) keeps only the norms registered before the top of
    the trunk: ViT blocks 0..n-4 (ViT-B/16: blocks 0-8, not the final norm), or
    for staged nets (ConvNeXt) the stem and every stage but the last.
    BatchNorm is refused when private: a BN layer normalizes each sample with
    statistics of the whole batch, so one sample's gradient depends on the others
    and its clipped norm no longer bounds what it can change.
    """
    if private:
        bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bn:
            raise ValueError(
                f"private adaptation needs per-sample gradients, but BatchNorm ({bn[0]}, ...) mixes "
                "samples of a batch; use a LayerNorm/GroupNorm model (ViT, ConvNeXt, ResNet-GN)")
    cut, params, past_cut = _trunk_cut(model) if skip_top else None, {}, False
    for name, module in model.named_modules():
        past_cut = past_cut or name == cut
        if isinstance(module, NORMS) and not past_cut:
            for pname, p in module.named_parameters(recurse=False):
                params[f"{name}.{pname}"] = p
    if not params:
        raise ValueError("the model has no LayerNorm/GroupNorm affine parameters to adapt")
    return params


def per_sample_grads(model, params, loss_fn, x, ctx=None, *, chunk_size=None):
    """g_i = ∇θ loss_fn(f_θ(x_i), ctx_i) for every sample i, and the logits of that same forward.

    params: {name: tensor} to differentiate (the adapted ones); every other
    parameter and buffer is passed unbatched and frozen. loss_fn maps logits
    [N, K] (and ctx [N, ...]) to per-sample losses [N]. Returns ({name: [B, *shape]}, logits).
    """
    frozen = {n: t.detach() for n, t in model.named_parameters() if n not in params}
    frozen.update(model.named_buffers())

    def loss_one(p, xi, ci):
        logits = functional_call(model, (p, frozen), (xi[None],))
        return loss_fn(logits, None if ci is None else ci[None]).sum(), logits[0]

    in_dims = (None,                         # the adapted parameters: shared by every sample
               0,                            # x: one image per call
               None if ctx is None else 0)   # per-sample context, e.g. DeYO's shuffled probs
    params = {n: p.detach() for n, p in params.items()}
    return vmap(grad(loss_one, has_aux=True), in_dims=in_dims, chunk_size=chunk_size)(params, x, ctx)


def clip_and_noise(per_sample_grads, clip, sigma, generator, stats=None):
    """Δ = (Σ_i g_i·min(1, C/‖g_i‖₂) + N(0, σ²C²I)) / B, the norm taken over all tensors jointly.

    The noise is calibrated to the *sum* (sensitivity 2C under replace-one) and
    only then divided by B: noise σC/B on a mean would be B times too small.
    Everything runs in fp32, also under bf16 autocast: a rounded clip factor can
    push a norm over C, and bf16 noise has too few bits to be Gaussian.
    A non-finite g_i counts as zero (tallied in stats["nonfinite"] if given). That
    keeps the guarantee: the decision depends on sample i alone and zero has norm
    <= C, so replacing sample i still moves the sum by at most 2C. The tally is
    a fact about the data: it is not covered by the guarantee, do not publish it.
    """
    with torch.autocast(next(iter(per_sample_grads.values())).device.type, enabled=False):
        g = {n: t.float() for n, t in per_sample_grads.items()}
        B = next(iter(g.values())).shape[0]
        # ‖g_i‖₂ over every adapted tensor together
        norms = torch.stack([t.flatten(1).pow(2).sum(1) for t in g.values()]).sum(0).sqrt()
        finite = torch.isfinite(norms)
        # min(1, C/‖g_i‖), and 0 for a non-finite g_i
        factor = torch.where(finite, (clip / norms.clamp(min=1e-12)).clamp(max=1.0), 0.0)
        if stats is not None:
            stats["nonfinite"] = stats.get("nonfinite", 0) + (~finite).sum()
        out = {}
        for name, t in g.items():
            t = torch.where(finite.view(-1, *[1] * (t.dim() - 1)), t, 0.0)  # NaN·0 is NaN: select first
            total = (factor.view(-1, *[1] * (t.dim() - 1)) * t).sum(0)
            if sigma > 0:  # fresh noise for every tensor, N(0, σ²C²) per coordinate
                total = total + sigma * clip * torch.randn(
                    total.shape, generator=generator, device=total.device)
            out[name] = total / B
        return out


# ----------------------------------------------------------------------------
# Losses: per sample, logits [N, K] -> [N]; K is read from the logits


def entropy(logits):
    # H(p) = −Σ_k p_k log p_k, p = softmax(z)
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def come_entropy(logits):
    """COME: entropy of the Dirichlet opinion [b, u] instead of the softmax."""
    z = logits.float()
    # z ← z/‖z‖·stopgrad(‖z‖): same value, no gradient along z (no logit-norm inflation)
    norm = z.norm(dim=-1, keepdim=True)
    z = z / norm * norm.detach()
    # b = e^z / (Σ e^z + K), u = K / (Σ e^z + K)  ⇔  [b, u] = softmax([z, ln K]), overflow-free
    log_k = torch.full_like(z[..., :1], math.log(z.shape[-1]))
    q = torch.cat([z, log_k], -1).softmax(-1) + 1e-7
    # −Σ_{j=1}^{K+1} q_j log q_j
    return -(q * q.log()).sum(-1)


def plpd(logits, shuffled_probs):
    # PLPD = p(ŷ|x) − p(ŷ|x′), ŷ = argmax p(·|x): how much the prediction rests on object shape
    p = logits.float().softmax(-1)
    y = p.argmax(-1, keepdim=True)
    return (p.gather(-1, y) - shuffled_probs.gather(-1, y)).squeeze(-1).detach()


def confidence_weighted(logits, shuffled_probs=None, *, ent=entropy, e_margin=0.4):
    """EATA: exp(E0 − H)·H; DeYO (given shuffled probs): (exp(−(H − E0)) + exp(PLPD))·H."""
    H = ent(logits)
    # w = exp(E0 − H), E0 = e_margin·ln K, a constant weight (detached)
    w = torch.exp(e_margin * math.log(logits.shape[-1]) - H.detach())
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
    dp_<method>: (eps, delta)-DP, filters removed (a filter decides on one sample
    by looking at the model, fine, but EATA's redundancy filter and the SAR
    recovery read the whole stream, and a dropped sample would change the
    divisor), weights moved inside the per-sample loss, eps=inf = the DP recipe
    without noise. Every step is SGD with momentum 0.9 on the adapted norms.
    """

    def __init__(self, model, method, *, eps=None, delta=1e-6, clip=None, lr=None, seed=0,
                 setting="continual", fisher_data=None, fisher_size=2000, fisher_lambda=2000.0,
                 e_margin=0.4, d_margin=0.05, rho=0.05, reset_ema=0.2, deyo_margin=0.5,
                 plpd_threshold=0.2, patch_grid=4, chunk_size=None):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.private = method, method.startswith("dp_")
        self.kind = method.removeprefix("dp_")
        if self.private and eps is None:
            raise ValueError(f"{method} needs eps (inf = clip only, no noise)")
        if not self.private and eps is not None:
            raise ValueError(f"eps applies to the dp_ methods only, not {method}")
        self.eps, self.delta = (eps, delta) if self.private else (None, None)
        self.sigma = calibrate_sigma(eps, delta) if self.private else 0.0
        paper_clip, paper_lr, _ = paper_hparams(method, eps if self.private else math.inf, setting, clip)
        self.clip = float(clip if clip is not None else paper_clip) if paper_clip is not None or clip else None
        self.lr = float(lr if lr is not None else paper_lr)
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}")
        self.model = model.eval()  # eval: no dropout, and nothing random under vmap
        self.model.requires_grad_(False)
        if self.kind == "source":
            return
        self.params = adaptable_params(model, skip_top=self.kind in SKIP_TOP, private=self.private)
        for p in self.params.values():
            p.requires_grad_(True)
        self.hp = dict(e_margin=e_margin, d_margin=d_margin, rho=rho, reset_ema=reset_ema,
                       deyo_margin=deyo_margin, plpd_threshold=plpd_threshold, patch_grid=patch_grid,
                       fisher_lambda=fisher_lambda)
        self.chunk_size = chunk_size
        ent = come_entropy if self.kind in ("come", "deyo_come") else entropy
        self.ent = ent
        # ℓ_i: the per-sample loss whose gradient is clipped (weights included, all detached)
        self.loss = {"tent": lambda z, ctx: ent(z), "come": lambda z, ctx: ent(z), "sar": lambda z, ctx: ent(z),
                     "eata": partial(confidence_weighted, e_margin=e_margin),
                     "deyo": partial(confidence_weighted, ent=ent, e_margin=e_margin),
                     "deyo_come": partial(confidence_weighted, ent=ent, e_margin=e_margin)}[self.kind]
        device = next(iter(self.params.values())).device
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
        self.stats = {}
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
        K = math.log(logits.shape[-1])
        H = self.ent(logits.detach())
        if self.kind == "deyo" or self.kind == "deyo_come":
            new = (H < self.hp["deyo_margin"] * K) & (plpd(logits, ctx) > self.hp["plpd_threshold"])
        else:  # eata, sar: reliable samples, H < E0
            new = H < self.hp["e_margin"] * K
        if self.kind == "eata":  # redundancy: skip samples that look like the recent average
            p = logits.detach().float().softmax(-1)
            if self.m is not None:
                new &= F.cosine_similarity(self.m[None], p, dim=1).abs() < self.hp["d_margin"]
            if new.any():  # m ← 0.9·m + 0.1·mean(p of kept)
                mean = p[new].mean(0)
                self.m = mean if self.m is None else 0.9 * self.m + 0.1 * mean
        return new if keep is None else keep & new

    def _shuffled_probs(self, x):
        # DeYO's extra forward on the patch-shuffled x′, batched and without gradient
        with torch.no_grad():
            xs = patch_shuffle(x, self.hp["patch_grid"], self.shuffle_gen)
            return self.model(xs).float().softmax(-1)

    def _grad(self, x, ctx, shift=None, keep=None):
        """(logits, Δ, kept) at θ + shift: Δ averages the kept samples' gradients, None if none."""
        p = {n: (t + shift[n] if shift else t).detach() for n, t in self.params.items()}
        if self.clip is None:  # plain TTA: one batched backward of the mean kept loss
            p = {n: t.requires_grad_() for n, t in p.items()}
            logits = functional_call(self.model, p, (x,))
            keep = self._keep(logits, ctx, keep)
            losses = self.loss(logits, ctx)
            if keep is not None:
                if not keep.any():
                    return logits, None, keep
                losses = losses[keep]
            g = torch.autograd.grad(losses.mean(), list(p.values()))
            return logits, {n: t.float() for n, t in zip(p, g)}, keep
        g, logits = per_sample_grads(self.model, p, self.loss, x, ctx, chunk_size=self.chunk_size)
        keep = self._keep(logits, ctx, keep)
        if keep is not None:  # originals only: the sample set (and B) is data dependent
            if not keep.any():
                return logits, None, keep
            g = {n: t[keep] for n, t in g.items()}
        return logits, clip_and_noise(g, self.clip, self.sigma, self.noise_gen, self.stats), keep

    def forward(self, x):
        if self.kind == "source":
            with torch.no_grad():
                return self.model(x)
        ctx = self._shuffled_probs(x) if self.kind in ("deyo", "deyo_come") else None
        if self.kind == "sar" and not self.private:
            logits, g, keep = self._grad(x, ctx)
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
