/* Temperature and top-p sampling of whole rows of logits, a few vectorized passes over each row, no sort.
 *
 * Row r: e_i = exp((x_i - max) / T), Z = sum e. A draw is an exponential race (race() below): token i with
 * probability e_i / Z, robust to tiny changes in the logits. Top-p by rejection (runtime/sample/sampler.py's module
 * docstring): the draw j is kept when the mass of tokens strictly more likely than j is below top_p x Z;
 * otherwise every token no more likely than j is outside the nucleus as well, so those are zeroed and the
 * row draws again among the rest, whose mass is exactly the mass above j. Accepted draws follow the nucleus's
 * renormalised distribution, and each round accepts with probability >= top_p.
 *
 * Randomness: each round's race is keyed by splitmix64 from the caller's uniform for the row (drawn from the
 * request's own generator when it is seeded), so a row's token depends only on its logits, its parameters
 * and its uniform. Tokens whose logit lies more than 87 below the row's largest, masked ones
 * (-inf) included, get e = 0 and are never drawn. A row with no finite logit takes its first largest one.
 * top_p arrives as a float32 and the mass above is a sum of float32 terms, so the comparison allows a relative
 * 1e-6: a token exactly on the boundary (the mass before it equals top_p) is cut, whatever the rounding.
 * Rows run in parallel over `num_threads` OpenMP threads; `work` holds R x V floats of scratch.
 * Greedy rows (temperature 0) take greedy_sample, at the end: torch.argmax's answer in one vectorized pass.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kernels.h"
#include "vector_exp.h"

#define MAX_ROUNDS 64

static inline uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int64_t first_max(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (x[i] > x[best] || (x[best] != x[best] && x[i] == x[i])) best = i;
    return best;
}

/* W hashes at a time (a 32-bit integer finalizer): the counter-based noise of a race. */
static inline vu vhash(vu x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* An exponential race: token i draws E_i ~ Exp(1) from a hash of (i, key) and the largest e_i / E_i wins,
 * which is token i with probability e_i / sum e. Unlike an inverse CDF in index order, a tiny change in the
 * logits (another batch, a recomputation after preemption) changes the winner only when two scores tie to
 * within that change: the same draw, not a different one among a run of unlikely tokens. */
static int64_t race(const float *e, int64_t V, uint64_t key) {
    const int64_t Vv = V - V % W;
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    vu index = {0};
    for (int l = 0; l < W; l++) index[l] = (uint32_t)l;
    vf best = (vf){0} - 1.f;
    vi best_at = (vi){0} - 1;
    for (int64_t i = 0; i < Vv; i += W) {
        const vu at = index + (uint32_t)i;
        const vu h = vhash(vhash(at * 0x9e3779b1u ^ k0) ^ k1);
        const vf u = (__builtin_convertvector(h >> 8, vf) + 0.5f) * 0x1.0p-24f; /* in (0, 1) */
        const vf score = *(const vf *)(e + i) / -vlog(u);
        const vi better = score > best;
        best = (vf)((better & (vi)score) | (~better & (vi)best));
        best_at = (better & (vi)at) | (~better & best_at);
    }
    float top = -1.f;
    int64_t j = -1;
    for (int l = 0; l < W; l++)
        if (best[l] > top) top = best[l], j = best_at[l];
    for (int64_t i = Vv; i < V; i++) {
        const uint32_t h1 = (uint32_t)i * 0x9e3779b1u ^ k0;
        vu one = {0};
        one[0] = h1;
        const vu h = vhash(vhash(one) ^ k1);
        const float u = ((float)(h[0] >> 8) + 0.5f) * 0x1.0p-24f;
        const float score = e[i] / -logf(u);
        if (score > top) top = score, j = i;
    }
    return top > 0.f ? j : -1;
}

/* Sum of the e strictly greater than ej. */
static double mass_above(const float *e, int64_t V, float ej) {
    const int64_t Vv = V - V % W;
    const vf t = (vf){0} + ej;
    vf acc = {0};
    for (int64_t i = 0; i < Vv; i += W) {
        const vf v = *(const vf *)(e + i);
        acc += (vf)((vi)(v > t) & (vi)v);
    }
    double sum = hsum(acc);
    for (int64_t i = Vv; i < V; i++)
        if (e[i] > ej) sum += e[i];
    return sum;
}

static int64_t sample_row(const float *x, int64_t V, float temperature, float top_p, double uniform, float *e) {
    const int64_t Vv = V - V % W;
    vf vmax = (vf){0} - INFINITY;
    for (int64_t i = 0; i < Vv; i += W) {
        const vf v = *(const vf *)(x + i);
        vmax = (vf)(((vi)(v > vmax) & (vi)v) | (~(vi)(v > vmax) & (vi)vmax));
    }
    float m = -INFINITY;
    for (int i = 0; i < W; i++) m = vmax[i] > m ? vmax[i] : m;
    for (int64_t i = Vv; i < V; i++) m = x[i] > m ? x[i] : m;
    if (!isfinite(m)) return first_max(x, V);
    const float scale = 1.f / temperature;
    const vf vm = (vf){0} + m, vscale = (vf){0} + scale, floor = (vf){0} - 87.f;
    vf acc = {0};
    for (int64_t i = 0; i < Vv; i += W) {
        const vf z = (*(const vf *)(x + i) - vm) * vscale;
        const vf v = (vf)((vi)(z >= floor) & (vi)vexp(z)); /* -inf, NaN and the far tail: 0 */
        *(vf *)(e + i) = v;
        acc += v;
    }
    double total = hsum(acc);
    for (int64_t i = Vv; i < V; i++) {
        const float z = (x[i] - m) * scale;
        e[i] = z >= -87.f ? expf(z) : 0.f;
        total += e[i];
    }
    if (!(total > 0.0)) return first_max(x, V);
    /* a token whose mass above reaches top_p to within float rounding is outside, as with exact arithmetic */
    const double nucleus = (double)top_p * total * (1.0 - 1e-6);
    uint64_t state;
    memcpy(&state, &uniform, sizeof state);
    for (int round = 0; round < MAX_ROUNDS; round++) {
        const int64_t j = race(e, V, splitmix64(&state));
        if (j < 0) break;
        if (top_p >= 1.f) return j;
        const double above = mass_above(e, V, e[j]);
        if (above < nucleus) return j;
        const vf t = (vf){0} + e[j];
        for (int64_t i = 0; i < Vv; i += W) {
            const vf v = *(vf *)(e + i);
            *(vf *)(e + i) = (vf)((vi)(v > t) & (vi)v);
        }
        for (int64_t i = Vv; i < V; i++)
            if (!(e[i] > e[j])) e[i] = 0.f;
    }
    return first_max(e, V); /* rejected 64 times: a rounding corner; the most likely token left */
}

/* logits [R, V] float32 with row stride `stride`; temperature, top_p: per row (temperature > 0, top_p in
 * (0, 1]); uniforms: one U[0, 1) per row; out: R token ids. */
void nucleus_sample(const float *logits, int64_t R, int64_t V, int64_t stride, const float *temperature,
                    const float *top_p, const double *uniforms, float *work, int64_t *out, int num_threads) {
    CHECK(R >= 0, R);
    CHECK(V > 0, V);
    CHECK(stride >= 0, stride); /* 0: one row broadcast to all */
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(logits, R);
    CHECK_PTR(temperature, R);
    CHECK_PTR(top_p, R);
    CHECK_PTR(uniforms, R);
    CHECK_PTR(work, R);
    CHECK_PTR(out, R);
    const int threads = R > 1 ? threads_for(R * V, num_threads) : 1;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int64_t r = 0; r < R; r++)
        out[r] = sample_row(logits + r * stride, V, temperature[r], top_p[r], uniforms[r], work + r * V);
}

/* Greedy rows: out[r] = the index of row r's largest logit, its first where several tie, and its first NaN
 * where it holds one (torch.argmax's answer). One vectorized pass: each lane keeps its largest value and the
 * first index it was seen at (a strict comparison); the lanes are then merged by value, then by index, and
 * the tail of fewer than W logits is compared one by one. */
void greedy_sample(const float *logits, int64_t R, int64_t V, int64_t stride, int64_t *out, int num_threads) {
    CHECK(R >= 0, R);
    CHECK(V > 0 && V < INT32_MAX, V);
    CHECK(stride >= 0, stride);
    CHECK(num_threads > 0, num_threads);
    CHECK_PTR(logits, R);
    CHECK_PTR(out, R);
    const int threads = R > 1 ? threads_for(R * V, num_threads) : 1;
    const int64_t whole = V / W * W;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *x = logits + r * stride;
        vf best = (vf){0} - INFINITY;
        vi at, lane, nan = {0};
        for (int j = 0; j < W; j++) at[j] = lane[j] = j;
        for (int64_t i = 0; i < whole; i += W) {
            const vf v = *(const vf *)(x + i);
            const vi more = (vi)(v > best);
            nan |= (vi)(v != v);
            best = (vf)((more & (vi)v) | (~more & (vi)best));
            at = (more & (lane + (int32_t)i)) | (~more & at);
        }
        int any_nan = 0;
        for (int j = 0; j < W; j++) any_nan |= nan[j] != 0;
        for (int64_t i = whole; i < V; i++) any_nan |= x[i] != x[i];
        int64_t pick = 0;
        if (any_nan) {
            while (x[pick] == x[pick]) pick++;
        } else {
            float top = best[0];
            for (int j = 1; j < W; j++) top = best[j] > top ? best[j] : top;
            pick = INT64_MAX;
            for (int j = 0; j < W; j++)
                if (best[j] == top && at[j] < pick) pick = at[j];
            for (int64_t i = whole; i < V; i++)
                if (x[i] > top) top = x[i], pick = i;
            if (pick >= V) pick = 0; /* fewer logits than lanes, all -inf */
        }
        out[r] = pick;
    }
}
