"""Derive the polynomial coefficients of detinfer/numerics.py (needs mpmath: pip install mpmath).

exp(r) = 1 + r + r^2 Q(r) on |r| <= ln2/2, Q a near-minimax (Chebyshev, mpmath.chebyfit) fit of
(exp(r) - 1 - r) / r^2, each coefficient rounded once to float64. Prints the coefficients (highest degree
first) and the polynomial's relative error (2001 points, exact arithmetic); the printed values are the literals in detinfer/numerics.py.
"""

import mpmath as mp

mp.mp.dps = 50


def q_fit(degree: int) -> tuple[list[float], float]:
    h = mp.log(2) / 2
    g = lambda r: (mp.exp(r) - 1 - r) / r**2 if r != 0 else mp.mpf(1) / 2  # noqa: E731
    coeffs = [float(c) for c in mp.chebyfit(g, [-h, h], degree + 1)]
    worst = mp.mpf(0)
    for k in range(-1000, 1001):  # relative error of 1 + r + r^2 Q(r) against exp(r), exact arithmetic
        r = h * k / 1000
        q = mp.mpf(0)
        for c in coeffs:
            q = q * r + mp.mpf(c)
        worst = max(worst, abs((1 + r + r * r * q) / mp.exp(r) - 1))
    return coeffs, float(worst)


if __name__ == "__main__":
    for name, degree in (("EXP32_Q", 8), ("EXP64_Q", 10)):
        coeffs, err = q_fit(degree)
        print(f"{name} = ({', '.join(repr(c) for c in coeffs)})  # relative fit error {err:.2e}")
