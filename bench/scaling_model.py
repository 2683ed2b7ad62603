"""The scaling model of bench/README.md ("Scaling model"): the step time of
data-parallel training on P ranks as compute / P plus the part of the bucketed
ring Allreduce that the backward pass does not hide.

    python bench/scaling_model.py [--alpha-us 5] [--gbit 100] [--fc-compute-ms C]
                                  [--llama-compute-s C]

Per bucket k of n_k bytes (buckets in start order, one at a time on the network):
    t_k(P) = 2 (P - 1) alpha + 2 (P - 1) / P * n_k / beta          (ring Allreduce)
bucket k may start at s_k = r_k * B / P, where B is the backward pass's time on one
rank for the whole logical batch and r_k the fraction of the backward pass done
when its last gradient is final; it ends at f_k = max(f_{k-1}, s_k) + t_k, and
    step(P) = C / P + max(0, f_K - B / P)       (C: one rank's compute of the logical batch)
Weak scaling (each rank keeps its own batch) replaces C / P and B / P by the
per-rank figures of the measured 2-rank run.
"""
import argparse

MIB = 1 << 20


def buckets(arena_floats, groups, cap_bytes=25 * MIB):
    """(bytes, ready fraction) of each bucket cut from the end of an arena whose
    parameters are groups: [(floats, fraction of the backward pass done when their
    gradients are final)] in arena order."""
    per = cap_bytes // 4
    bounds, end = [], arena_floats
    while end > 0:
        bounds.append((max(0, end - per), end))
        end -= per
    out = []
    for lo, hi in bounds:
        ready, start = 0.0, 0
        for n, frac in groups:
            if start < hi and start + n > lo:
                ready = max(ready, frac)
            start += n
        out.append((4 * (hi - lo), ready))
    return out


def exposed(bk, p, alpha, beta, backward):
    """Seconds of exchange after the backward pass (backward: its seconds on one rank)."""
    f = 0.0
    for nbytes, ready in bk:
        t = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
        f = max(f, ready * backward) + t
    return max(0.0, f - backward)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--alpha-us", type=float, default=5.0)
    ap.add_argument("--gbit", type=float, default=100.0)
    ap.add_argument("--fc-compute-ms", type=float, required=True,
                    help="one single-threaded rank's compute of a logical batch of 1000")
    ap.add_argument("--llama-compute-s", type=float, required=True,
                    help="one single-threaded rank's compute of a logical batch of 16 x 256")
    ap.add_argument("--fc-backward-share", type=float, default=0.6,
                    help="mnist-fc: the backward pass's share of the compute (3 of its 5 "
                         "products)")
    ap.add_argument("--llama-backward-share", type=float, default=0.72,
                    help="llama: the backward pass's share of the compute (the profile)")
    args = ap.parse_args()
    alpha, beta = args.alpha_us * 1e-6, args.gbit * 1e9 / 8

    fc = buckets(397_510, [(392_000 + 500, 1.0), (5_010, 0.05)])
    layer = 4 * 288 * 288 + 3 * 288 * 768 + 2 * 288
    # llama backward (bench/README.md's profile): lm_head 32 %, then each layer 11.3 %
    llama_groups = [(32000 * 288, 1.0)]
    llama_groups += [(layer, 0.32 + (6 - i) * 0.113) for i in range(6)]
    llama_groups += [(288, 0.32), (288 * 32000, 0.32)]
    llama = buckets(sum(n for n, _ in llama_groups), llama_groups)

    print(f"alpha {args.alpha_us} us, beta {beta / 1e9:.2f} GB/s ({args.gbit} Gbit/s), "
          f"bucket_cap_mb 25")
    for name, bk, c, share in (
            ("mnist-fc", fc, args.fc_compute_ms * 1e-3, args.fc_backward_share),
            ("stories15M llama", llama, args.llama_compute_s, args.llama_backward_share)):
        print(f"{name}: buckets (MB, ready at) "
              + ", ".join(f"{n / 1e6:.1f} @ {r:.2f}" for n, r in bk))
        for p in (2, 8, 64, 512):
            strong_b = share * c / p
            e_strong = exposed(bk, p, alpha, beta, strong_b)
            # weak scaling: every rank keeps the 2-rank run's share of the batch
            weak_c = c / 2
            e_weak = exposed(bk, p, alpha, beta, share * weak_c)
            print(f"  P={p:4d}: strong step {1e3 * (c / p + e_strong):10.2f} ms "
                  f"(exposed {1e3 * e_strong:7.2f} ms, {100 * e_strong / (c / p + e_strong):5.1f}%)"
                  f"; weak step {1e3 * (weak_c + e_weak):10.2f} ms (exposed "
                  f"{1e3 * e_weak:7.2f} ms, {100 * e_weak / (weak_c + e_weak):5.1f}%)")


if __name__ == "__main__":
    main()
