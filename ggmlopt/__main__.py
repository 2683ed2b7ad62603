"""python -m ggmlopt: show the build configuration and run one AdamW step.
python -m ggmlopt finetune ...: the fine-tuning command (python -m ggmlopt.finetune)."""
import sys

import numpy as np

import ggmlopt
from ggmlopt import kernels


def main(argv: list[str]) -> int:
    """The command for argv (the arguments after ``python -m ggmlopt``)."""
    if argv[:1] == ["finetune"]:
        from ggmlopt.finetune import main as finetune

        return finetune(argv[1:])
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv:
        print(f"python -m ggmlopt: takes no arguments (it shows the configuration and runs one "
              f"AdamW step), got {' '.join(argv)!r}; the fine-tuning command is "
              f"python -m ggmlopt finetune ... (or python -m ggmlopt.finetune ...)",
              file=sys.stderr)
        return 2
    ggmlopt.show_config()
    rng = np.random.default_rng(0)
    n = 1_000_003
    w, g = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    b1h, b2h = kernels.adamw_bias_corrections(0.9, 0.999, 1)
    w0 = w.copy()
    kernels.adamw_step(w, g, m, v, alpha=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0,
                       beta1h=b1h, beta2h=b2h)
    print(f"one AdamW step over {n} parameters: mean |dw| = {np.abs(w - w0).mean():.6f} "
          f"(expected ~1e-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
