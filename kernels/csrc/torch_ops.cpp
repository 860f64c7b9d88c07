/* The CPU kernels of this folder as torch ops, torch.ops.moe_serve.<name> (CPU tensors only): each op checks
 * its tensors' dtypes, shapes and strides (a ValueError in Python that names the tensor), takes their
 * addresses and strides, and calls the C kernel. The Python modules beside (kernels/cpu_*.py) call them and
 * hold their torch references. Only the torch headers these need, to keep the first build short.
 *
 * Every op writes into tensors its caller allocated (`out`, marked `(a!)`) and returns nothing. Weights are
 * bf16, or FP8 e4m3fn with float32 block scales `scale_inv` [(B,) ceil(O / bo), ceil(K / bk)] (any strides)
 * and block = [bo, bk], both multiples of 8; a weight needs unit stride along its input features only.
 */
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "bf16w.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

/* The checks build no message unless they fail: these ops run many times a step, at a few microseconds each. */
void expect(const Tensor &t, const char *name, at::ScalarType dtype, int64_t dim, const char *suffix = "") {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim, name, suffix, " must be a ",
                      dim, "-d ", dtype, " CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

void unit_last(const Tensor &t, const char *name) {
    TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have unit stride in its last dim, got ",
                      "strides ", t.strides(), " for shape ", t.sizes());
}

void contiguous(const Tensor &t, const char *name) {
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides(), " for shape ",
                      t.sizes());
}

void shape(const Tensor &t, const char *name, at::IntArrayRef want) {
    TORCH_CHECK_VALUE(t.sizes().equals(want), name, " must be ", want, ", got ", t.sizes());
}

/* w [(B,) O, K] (dim 2 or 3) with unit stride in K: bf16 and no scale, or FP8 e4m3fn and its block scales */
Weight weight(const Tensor &w, const OptTensor &scale, at::IntArrayRef block, const char *name, int64_t dim) {
    TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == dim, name, " must be a ", dim, "-d CPU tensor, got ",
                      w.sizes(), " on ", w.device());
    unit_last(w, name);
    Weight r = {w.data_ptr(), w.stride(dim - 2), dim == 3 ? w.stride(0) : 0, nullptr, 0, 0, 0, 0, 0};
    if (w.scalar_type() == at::kBFloat16) {
        TORCH_CHECK_VALUE(!scale.has_value(), name, " is bfloat16: it takes no scale");
        return r;
    }
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat8_e4m3fn, name, " must be BFloat16 or Float8_e4m3fn, got ",
                      w.scalar_type());
    TORCH_CHECK_VALUE(scale.has_value(), name, " is Float8_e4m3fn: pass its block scales (scale_inv)");
    TORCH_CHECK_VALUE(block.size() == 2 && block[0] > 0 && block[1] > 0 && block[0] % 8 == 0 && block[1] % 8 == 0,
                      "the FP8 block shape must be two positive multiples of 8, got ", block);
    const Tensor &s = *scale;
    expect(s, name, at::kFloat, dim, " scale");
    int64_t bo = block[0], bk = block[1];
    int64_t grid[3] = {w.size(0), (w.size(dim - 2) + bo - 1) / bo, (w.size(dim - 1) + bk - 1) / bk};
    at::IntArrayRef want(grid + 3 - dim, dim);
    TORCH_CHECK_VALUE(s.sizes().equals(want), name, " scale must be ", want, " for a weight ", w.sizes(),
                      " in blocks ", block, ", got ", s.sizes());
    r.scale = s.data_ptr<float>();
    r.lds = s.stride(dim - 2);
    r.ldsk = s.stride(dim - 1);
    r.bss = dim == 3 ? s.stride(0) : 0;
    r.bo = bo;
    r.bk = bk;
    return r;
}

/* The paged cache's tables and lengths of B sequences: every length within its table, every block in use
 * within the cache (num_blocks); rows (if any) within the query rows. */
void check_paged(const Tensor &tables, const Tensor &lens, const OptTensor &rows, int64_t B, int64_t q_rows,
                 int64_t num_blocks, int64_t bs) {
    expect(tables, "block_tables", at::kLong, 2);
    unit_last(tables, "block_tables");
    expect(lens, "context_lens", at::kLong, 1);
    contiguous(lens, "context_lens");
    TORCH_CHECK_VALUE(tables.size(0) >= B && lens.size(0) == B, "block_tables ", tables.sizes(), " and context_lens ",
                      lens.sizes(), " must hold ", B, " sequences");
    const int64_t *len = lens.data_ptr<int64_t>(), *tab = tables.data_ptr<int64_t>();
    int64_t M = tables.size(1);
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK_VALUE(len[b] >= 0 && len[b] <= M * bs, "a context of ", len[b], " tokens does not fit ", M,
                          " blocks of ", bs);
        for (int64_t i = 0; i < (len[b] + bs - 1) / bs; i++) {
            int64_t blk = tab[b * tables.stride(0) + i];
            TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "block ", blk, " of sequence ", b,
                              " is not in the cache of ", num_blocks, " blocks");
        }
    }
    if (rows.has_value()) {
        expect(*rows, "rows", at::kLong, 1);
        contiguous(*rows, "rows");
        shape(*rows, "rows", {B});
        const int64_t *r = rows->data_ptr<int64_t>();
        for (int64_t b = 0; b < B; b++)
            TORCH_CHECK_VALUE(r[b] >= 0 && r[b] < q_rows, "row ", r[b], " is not among the ", q_rows, " query rows");
    }
}

void check_slots(const Tensor &slots, int64_t T, int64_t cache_rows) {
    expect(slots, "slots", at::kLong, 1);
    contiguous(slots, "slots");
    shape(slots, "slots", {T});
    const int64_t *s = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++)
        TORCH_CHECK_VALUE(s[t] >= 0 && s[t] < cache_rows, "slot ", s[t], " is not in the cache of ", cache_rows,
                          " rows");
}

// out = x w^T: x [M, K] float32, w [O, K], out [M, O] float32 (unit stride in the last dims)
void mm_wt(const Tensor &x, const Tensor &w, const OptTensor &scale_inv, at::IntArrayRef block, const Tensor &out) {
    expect(x, "x", at::kFloat, 2);
    unit_last(x, "x");
    Weight wt = weight(w, scale_inv, block, "w", 2);
    int64_t M = x.size(0), K = x.size(1), O = w.size(0);
    TORCH_CHECK_VALUE(w.size(1) == K, "x ", x.sizes(), " and w ", w.sizes(), " must agree on in features");
    expect(out, "out", at::kFloat, 2);
    unit_last(out, "out");
    shape(out, "out", {M, O});
    if (M && O) linear_w(x.data_ptr<float>(), x.stride(0), &wt, out.data_ptr<float>(), out.stride(0), M, K, O);
}

// out[b] = x[b] w[b]^T: x [B, M, K] float32, w [B, O, K], out [B, M, O] float32
void bmm_wt(const Tensor &x, const Tensor &w, const OptTensor &scale_inv, at::IntArrayRef block, const Tensor &out) {
    expect(x, "x", at::kFloat, 3);
    unit_last(x, "x");
    Weight wt = weight(w, scale_inv, block, "w", 3);
    int64_t B = x.size(0), M = x.size(1), K = x.size(2), O = w.size(1);
    TORCH_CHECK_VALUE(w.size(0) == B && w.size(2) == K, "x ", x.sizes(), " and w ", w.sizes(),
                      " must agree on the batch and in features");
    expect(out, "out", at::kFloat, 3);
    unit_last(out, "out");
    shape(out, "out", {B, M, O});
    if (B && M && O)
        linear_w_batched(x.data_ptr<float>(), x.stride(1), x.stride(0), &wt, out.data_ptr<float>(), out.stride(1),
                         out.stride(0), M, K, O, B);
}

// routed experts (+ a shared expert): see moe_bf16w.cpp
void fused_moe(const Tensor &x, const Tensor &w13, const Tensor &w2, const Tensor &topk_weights,
               const Tensor &topk_ids, const OptTensor &shared_w13, const OptTensor &shared_w2,
               const OptTensor &w13_scale, const OptTensor &w2_scale, const OptTensor &shared_w13_scale,
               const OptTensor &shared_w2_scale, at::IntArrayRef block, const Tensor &out) {
    expect(x, "x", at::kFloat, 2);
    unit_last(x, "x");
    Weight a = weight(w13, w13_scale, block, "w13", 3), b = weight(w2, w2_scale, block, "w2", 3);
    int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w2.size(2);
    shape(w13, "w13", {E, 2 * I, H});
    shape(w2, "w2", {E, H, I});
    expect(topk_ids, "topk_ids", at::kLong, 2);
    contiguous(topk_ids, "topk_ids");
    int64_t K = topk_ids.size(1);
    shape(topk_ids, "topk_ids", {T, K});
    expect(topk_weights, "topk_weights", at::kFloat, 2);
    contiguous(topk_weights, "topk_weights");
    shape(topk_weights, "topk_weights", {T, K});
    expect(out, "out", at::kFloat, 2);
    contiguous(out, "out");
    shape(out, "out", {T, H});
    TORCH_CHECK_VALUE(shared_w13.has_value() == shared_w2.has_value(), "pass both shared expert weights or neither");
    Weight sa = {}, sb = {};
    int64_t S = 0;
    if (shared_w13.has_value()) {
        sa = weight(*shared_w13, shared_w13_scale, block, "shared_w13", 2);
        sb = weight(*shared_w2, shared_w2_scale, block, "shared_w2", 2);
        S = shared_w2->size(1);
        shape(*shared_w13, "shared_w13", {2 * S, H});
        shape(*shared_w2, "shared_w2", {H, S});
    }
    if (!T) return;
    const int64_t *ids = topk_ids.data_ptr<int64_t>();
    int64_t status = moe_w(x.data_ptr<float>(), x.stride(0), T, H, &a, &b, E, I, ids,
                           topk_weights.data_ptr<float>(), K, out.data_ptr<float>(), S ? &sa : nullptr, S, &sb);
    TORCH_CHECK_VALUE(status <= 0, "topk_ids must lie in [-1, ", E, ") for ", E, " local experts, got ",
                      status > 0 ? ids[status - 1] : 0);
    TORCH_CHECK(status == 0, "fused_moe: no memory for the CPU kernel's scratch");
}

// MLA decode attention over the paged bf16 latent cache: see mla_decode_bf16.cpp
void mla_decode(const Tensor &q, const Tensor &kv_cache, const Tensor &block_tables, const Tensor &context_lens,
                const OptTensor &rows, int64_t latent_dim, double scale, const Tensor &out) {
    expect(q, "q", at::kFloat, 3);
    unit_last(q, "q");
    expect(kv_cache, "kv_cache", at::kBFloat16, 3);
    contiguous(kv_cache, "kv_cache");
    int64_t N = q.size(1), D = q.size(2), C = latent_dim, bs = kv_cache.size(1);
    TORCH_CHECK_VALUE(kv_cache.size(2) == D && 0 < C && C <= D, "kv_cache ", kv_cache.sizes(), ", q ", q.sizes(),
                      " and latent_dim ", C, " disagree");
    expect(out, "out", at::kFloat, 3);
    unit_last(out, "out");
    shape(out, "out", {q.size(0), N, C});
    int64_t B = rows.has_value() ? rows->size(0) : q.size(0);
    check_paged(block_tables, context_lens, rows, B, q.size(0), kv_cache.size(0), bs);
    if (!B) return;
    int64_t status = mla_decode_bf16(
        q.data_ptr<float>(), q.stride(0), q.stride(1), (const uint16_t *)kv_cache.data_ptr(), bs, D,
        block_tables.data_ptr<int64_t>(), block_tables.stride(0), context_lens.data_ptr<int64_t>(),
        out.data_ptr<float>(), out.stride(0), out.stride(1), B, N, C, (float)scale,
        rows.has_value() ? rows->data_ptr<int64_t>() : nullptr);
    TORCH_CHECK(status == 0, "mla_decode: no memory for the CPU kernel's scratch");
}

void rms_norm(const Tensor &x, const Tensor &weight, double eps, const Tensor &out) {
    expect(x, "x", at::kFloat, 2);
    unit_last(x, "x");
    int64_t T = x.size(0), D = x.size(1);
    expect(weight, "weight", at::kFloat, 1);
    contiguous(weight, "weight");
    shape(weight, "weight", {D});
    expect(out, "out", at::kFloat, 2);
    unit_last(out, "out");
    shape(out, "out", {T, D});
    rms_norm_f32(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(), out.stride(0),
                 T, D, (float)eps);
}

void check_cos_sin(const Tensor &cos, const Tensor &sin, int64_t T, int64_t R) {
    TORCH_CHECK_VALUE(R % 2 == 0, "rope dims must be even, got ", R);
    for (const Tensor *t : {&cos, &sin}) {
        const char *name = t == &cos ? "cos" : "sin";
        expect(*t, name, at::kFloat, 2);
        contiguous(*t, name);
        shape(*t, name, {T, R / 2});
    }
}

// rotary embedding of x [T, N, R] into out [T, N, R]: see cpu_ops.cpp
void rope(const Tensor &x, const Tensor &cos, const Tensor &sin, bool interleaved, const Tensor &out) {
    expect(x, "x", at::kFloat, 3);
    unit_last(x, "x");
    int64_t T = x.size(0), N = x.size(1), R = x.size(2);
    check_cos_sin(cos, sin, T, R);
    expect(out, "out", at::kFloat, 3);
    unit_last(out, "out");
    shape(out, "out", {T, N, R});
    rope_f32(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
             out.data_ptr<float>(), out.stride(0), out.stride(1), T, N, R, interleaved);
}

// MLA's cache write of kv [T, C + R] into rows `slots` of the bf16 cache [..., C + R]: see cpu_ops.cpp
void mla_cache_write(const Tensor &kv, const Tensor &norm_weight, double eps, const Tensor &cos, const Tensor &sin,
                     bool interleaved, const Tensor &kv_cache, const Tensor &slots) {
    expect(kv, "kv", at::kFloat, 2);
    unit_last(kv, "kv");
    expect(norm_weight, "norm_weight", at::kFloat, 1);
    contiguous(norm_weight, "norm_weight");
    int64_t T = kv.size(0), C = norm_weight.size(0), R = kv.size(1) - C;
    TORCH_CHECK_VALUE(R > 0, "kv ", kv.sizes(), " must hold the latent (", C, ") and rope dims");
    check_cos_sin(cos, sin, T, R);
    TORCH_CHECK_VALUE(kv_cache.device().is_cpu() && kv_cache.scalar_type() == at::kBFloat16 && kv_cache.dim() >= 2 &&
                      kv_cache.size(-1) == C + R, "kv_cache must be a bf16 CPU tensor [..., ", C + R, "], got ",
                      kv_cache.scalar_type(), " ", kv_cache.sizes());
    contiguous(kv_cache, "kv_cache");
    check_slots(slots, T, kv_cache.numel() / (C + R));
    mla_cache_write_bf16(kv.data_ptr<float>(), kv.stride(0), norm_weight.data_ptr<float>(), (float)eps,
                         cos.data_ptr<float>(), sin.data_ptr<float>(), interleaved, (uint16_t *)kv_cache.data_ptr(),
                         slots.data_ptr<int64_t>(), T, C, R);
}

void check_routing(int64_t E, int64_t G, int64_t topk_group, int64_t K) {
    TORCH_CHECK_VALUE(G >= 1 && E % G == 0 && 1 <= topk_group && topk_group <= G && 0 < K &&
                      K <= topk_group * (E / G), "routing ", K, " of ", E, " experts in ", G, " groups (top ",
                      topk_group, " groups) is not supported");
}

// DeepSeek-V3's router: see cpu_ops.cpp; weights and ids [T, K]
void route_noaux_tc(const Tensor &x, const Tensor &gate, const OptTensor &bias, int64_t num_groups, int64_t topk_group,
                    bool norm_topk_prob, double scale, const Tensor &weights, const Tensor &ids) {
    expect(x, "x", at::kFloat, 2);
    unit_last(x, "x");
    int64_t T = x.size(0), H = x.size(1), E = gate.size(0), K = ids.size(-1);
    expect(gate, "gate", at::kFloat, 2);
    contiguous(gate, "gate");
    shape(gate, "gate", {E, H});
    if (bias.has_value()) {
        expect(*bias, "bias", at::kFloat, 1);
        contiguous(*bias, "bias");
        shape(*bias, "bias", {E});
    }
    check_routing(E, num_groups, topk_group, K);
    expect(ids, "ids", at::kLong, 2);
    contiguous(ids, "ids");
    shape(ids, "ids", {T, K});
    expect(weights, "weights", at::kFloat, 2);
    contiguous(weights, "weights");
    shape(weights, "weights", {T, K});
    route_noaux_tc_f32(x.data_ptr<float>(), x.stride(0), gate.data_ptr<float>(), H,
                       bias.has_value() ? bias->data_ptr<float>() : nullptr, T, E, num_groups, topk_group, K,
                       norm_topk_prob, (float)scale, ids.data_ptr<int64_t>(), weights.data_ptr<float>());
}

/* decode_layer's tensors, in this order (kernels/cpu_decode_layer.py TENSORS names them the same) */
enum {
    IN_NORM, Q_A, Q_A_SCALE, Q_A_NORM, Q_B, Q_B_SCALE, KV_A, KV_A_SCALE, KV_A_NORM, W_UK, W_UK_SCALE, W_UV,
    W_UV_SCALE, O, O_SCALE, POST_NORM, ROUTER, ROUTER_BIAS, W13, W13_SCALE, W2, W2_SCALE, MLP_W13, MLP_W13_SCALE,
    MLP_W2, MLP_W2_SCALE, NUM_TENSORS
};

const float *norm_vector(const OptTensor &t, const char *name, int64_t n) {
    TORCH_CHECK_VALUE(t.has_value(), name, " is missing");
    expect(*t, name, at::kFloat, 1);
    contiguous(*t, name);
    shape(*t, name, {n});
    return t->data_ptr<float>();
}

/* One decoder layer's decode step, x updated in place: see decode_layer.cpp. weights: the tensors above
 * (None where absent: q_a and q_a_norm without q compression, every scale of a bf16 weight, the router and
 * experts of a dense layer, the MLP of a layer without shared experts); config: [interleaved, num_groups,
 * topk_group, top_k, norm_topk_prob, block rows, block cols] (the block when a weight is FP8); scalars:
 * [eps of in_norm, q_a_norm, kv_a_norm, post_norm, softmax_scale, routed_scaling_factor]. x [T, H];
 * cos / sin [T, R / 2]; kv_cache [blocks, bs, C + R] bf16; slots, rows [T]; block_tables [T, M];
 * context_lens [T]; ids (optional) [T, top_k] receives the routed experts. T = 0 only checks the weights. */
void decode_layer(const Tensor &x, const c10::List<OptTensor> &weights, at::IntArrayRef config,
                  at::ArrayRef<double> scalars, const Tensor &cos, const Tensor &sin, const Tensor &kv_cache,
                  const Tensor &slots, const Tensor &rows, const Tensor &block_tables, const Tensor &context_lens,
                  const OptTensor &ids) {
    TORCH_CHECK_VALUE(weights.size() == NUM_TENSORS && config.size() == 7 && scalars.size() == 6, "decode_layer takes ",
                      NUM_TENSORS, " tensors, 7 ints and 6 floats, got ", weights.size(), ", ", config.size(), " and ",
                      scalars.size());
    OptTensor t[NUM_TENSORS];
    for (size_t i = 0; i < NUM_TENSORS; i++) t[i] = weights.get(i);
    at::IntArrayRef block = config.slice(5, 2);
    auto weight_of = [&](int i, const char *name, int64_t dim) { return weight(*t[i], t[i + 1], block, name, dim); };
    auto need = [&](int i, const char *name) {
        TORCH_CHECK_VALUE(t[i].has_value(), "decode layer: ", name, " is missing");
    };
    DecodeLayer w = {};
    need(IN_NORM, "in_norm"), need(KV_A, "kv_a"), need(KV_A_NORM, "kv_a_norm"), need(W_UK, "w_uk"), need(W_UV, "w_uv");
    need(Q_B, "q_b"), need(O, "o");
    int64_t H = t[IN_NORM]->size(0), C = t[KV_A_NORM]->size(0), R = t[KV_A]->size(0) - C, N = t[W_UK]->size(0);
    int64_t Dn = t[W_UK]->size(-1), Dv = t[W_UV]->size(1), Qr = t[Q_A].has_value() ? t[Q_A]->size(0) : 0;
    w.H = H, w.Qr = Qr, w.N = N, w.Dn = Dn, w.R = R, w.Dv = Dv, w.C = C, w.interleaved = config[0];
    w.eps_in = (float)scalars[0], w.eps_q = (float)scalars[1], w.eps_kv = (float)scalars[2];
    w.eps_post = (float)scalars[3], w.softmax_scale = (float)scalars[4], w.routed_scale = (float)scalars[5];
    TORCH_CHECK_VALUE(R > 0 && R % 2 == 0, "decode layer: kv_a ", t[KV_A]->sizes(), " leaves ", R,
                      " rope dims after the latent ", C, "; they must be a positive even number");
    w.in_norm = norm_vector(t[IN_NORM], "in_norm", H);
    w.kv_a_norm = norm_vector(t[KV_A_NORM], "kv_a_norm", C);
    w.post_norm = norm_vector(t[POST_NORM], "post_norm", H);
    w.kv_a = weight_of(KV_A, "kv_a", 2);
    shape(*t[KV_A], "kv_a", {C + R, H});
    if (Qr) {
        w.q_a = weight_of(Q_A, "q_a", 2);
        shape(*t[Q_A], "q_a", {Qr, H});
        w.q_a_norm = norm_vector(t[Q_A_NORM], "q_a_norm", Qr);
    }
    w.q_b = weight_of(Q_B, "q_b", 2);
    shape(*t[Q_B], "q_b", {N * (Dn + R), Qr ? Qr : H});
    w.w_uk = weight_of(W_UK, "w_uk", 3);
    shape(*t[W_UK], "w_uk", {N, C, Dn});
    w.w_uv = weight_of(W_UV, "w_uv", 3);
    shape(*t[W_UV], "w_uv", {N, Dv, C});
    w.o = weight_of(O, "o", 2);
    shape(*t[O], "o", {H, N * Dv});
    if (t[ROUTER].has_value()) {
        int64_t E = t[ROUTER]->size(0);
        expect(*t[ROUTER], "router", at::kFloat, 2);
        contiguous(*t[ROUTER], "router");
        shape(*t[ROUTER], "router", {E, H});
        w.router = t[ROUTER]->data_ptr<float>();
        w.router_bias = t[ROUTER_BIAS].has_value() ? norm_vector(t[ROUTER_BIAS], "router_bias", E) : nullptr;
        w.E = E, w.G = config[1], w.topk_group = config[2], w.K = config[3], w.norm_topk = config[4];
        check_routing(E, w.G, w.topk_group, w.K);
        need(W13, "w13"), need(W2, "w2");
        w.Ie = t[W2]->size(-1);
        w.w13 = weight_of(W13, "w13", 3);
        shape(*t[W13], "w13", {E, 2 * w.Ie, H});
        w.w2 = weight_of(W2, "w2", 3);
        shape(*t[W2], "w2", {E, H, w.Ie});
    } else {
        TORCH_CHECK_VALUE(t[MLP_W13].has_value(), "decode layer: a layer needs routed experts or a dense MLP");
    }
    if (t[MLP_W13].has_value()) {
        need(MLP_W2, "mlp_w2");
        w.Is = t[MLP_W2]->size(-1);
        w.sw13 = weight_of(MLP_W13, "mlp_w13", 2);
        shape(*t[MLP_W13], "mlp_w13", {2 * w.Is, H});
        w.sw2 = weight_of(MLP_W2, "mlp_w2", 2);
        shape(*t[MLP_W2], "mlp_w2", {H, w.Is});
    }

    expect(x, "x", at::kFloat, 2);
    contiguous(x, "x");
    int64_t T = x.size(0);
    shape(x, "x", {T, H});
    check_cos_sin(cos, sin, T, R);
    expect(kv_cache, "kv_cache", at::kBFloat16, 3);
    contiguous(kv_cache, "kv_cache");
    TORCH_CHECK_VALUE(kv_cache.size(2) == C + R, "kv_cache ", kv_cache.sizes(), " must hold ", C + R, " dims a token");
    int64_t bs = kv_cache.size(1);
    check_slots(slots, T, kv_cache.size(0) * bs);
    check_paged(block_tables, context_lens, rows, T, T, kv_cache.size(0), bs);
    if (ids.has_value()) {
        expect(*ids, "ids", at::kLong, 2);
        contiguous(*ids, "ids");
        shape(*ids, "ids", {T, w.K});
    }
    if (!T) return;
    int64_t status = decode_layer_f32(&w, x.data_ptr<float>(), T, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                      (uint16_t *)kv_cache.data_ptr(), bs, slots.data_ptr<int64_t>(),
                                      rows.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                                      block_tables.stride(0), context_lens.data_ptr<int64_t>(),
                                      ids.has_value() ? ids->data_ptr<int64_t>() : nullptr);
    TORCH_CHECK_VALUE(status <= 0, "decode layer: routed expert id out of range at pair ", status - 1);
    TORCH_CHECK(status == 0, "decode layer: no memory for its scratch");
}

void causal_softmax(const Tensor &scores, int64_t per, int64_t seen0) {
    expect(scores, "scores", at::kFloat, 2);
    unit_last(scores, "scores");
    TORCH_CHECK_VALUE(per > 0 && seen0 > 0, "causal_softmax: queries per block (", per, ") and keys the first sees (",
                      seen0, ") must be positive");
    causal_softmax_f32(scores.data_ptr<float>(), scores.stride(0), scores.size(0), scores.size(1), per, seen0);
}

void values_t(const Tensor &v, const Tensor &out) {
    expect(v, "v", at::kFloat, 3);
    unit_last(v, "v");
    expect(out, "out", at::kBFloat16, 3);
    contiguous(out, "out");
    int64_t N = v.size(0), L = v.size(1), V = v.size(2);
    TORCH_CHECK_VALUE(out.size(0) == N && out.size(1) >= V && out.size(2) >= L && out.size(2) % 8 == 0, "out must be [",
                      N, ", >= ", V, ", >= ", L, " and a multiple of 8], got ", out.sizes());
    values_t_bf16(v.data_ptr<float>(), v.stride(0), v.stride(1), N, L, V, (uint16_t *)out.data_ptr(), out.size(1),
                  out.size(2));
}

}  // namespace

TORCH_LIBRARY(moe_serve, m) {
    m.def("mm_wt(Tensor x, Tensor w, Tensor? scale_inv, int[] block, Tensor(a!) out) -> ()");
    m.def("bmm_wt(Tensor x, Tensor w, Tensor? scale_inv, int[] block, Tensor(a!) out) -> ()");
    m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? shared_w13, "
          "Tensor? shared_w2, Tensor? w13_scale, Tensor? w2_scale, Tensor? shared_w13_scale, "
          "Tensor? shared_w2_scale, int[] block, Tensor(a!) out) -> ()");
    m.def("mla_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, Tensor? rows, "
          "int latent_dim, float scale, Tensor(a!) out) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
    m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved, Tensor(a!) out) -> ()");
    m.def("mla_cache_write(Tensor kv, Tensor norm_weight, float eps, Tensor cos, Tensor sin, bool interleaved, "
          "Tensor(a!) kv_cache, Tensor slots) -> ()");
    m.def("route_noaux_tc(Tensor x, Tensor gate, Tensor? bias, int num_groups, int topk_group, bool norm_topk_prob, "
          "float scale, Tensor(a!) weights, Tensor(b!) ids) -> ()");
    m.def("causal_softmax(Tensor(a!) scores, int per, int seen0) -> ()");
    m.def("values_t(Tensor v, Tensor(a!) out) -> ()");
    m.def("set_tile_rows(int rows) -> int", &set_tile_rows);
    m.def("expert_tile_rows() -> int", &expert_tile_rows);
    m.def("set_fp8_tiles(int on) -> int", &set_fp8_tiles);
    m.def("set_kernel_threads(int threads) -> int", &set_kernel_threads);
    m.def("decode_layer(Tensor(a!) x, Tensor?[] weights, int[] config, float[] scalars, Tensor cos, Tensor sin, "
          "Tensor(b!) kv_cache, Tensor slots, Tensor rows, Tensor block_tables, Tensor context_lens, "
          "Tensor(c!)? ids) -> ()");
}

TORCH_LIBRARY_IMPL(moe_serve, CPU, m) {
    m.impl("mm_wt", &mm_wt);
    m.impl("bmm_wt", &bmm_wt);
    m.impl("fused_moe", &fused_moe);
    m.impl("mla_decode", &mla_decode);
    m.impl("rms_norm", &rms_norm);
    m.impl("rope", &rope);
    m.impl("mla_cache_write", &mla_cache_write);
    m.impl("route_noaux_tc", &route_noaux_tc);
    m.impl("decode_layer", &decode_layer);
    m.impl("causal_softmax", &causal_softmax);
    m.impl("values_t", &values_t);
}
