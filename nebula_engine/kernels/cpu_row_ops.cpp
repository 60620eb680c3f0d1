// Row-wise fp32 ops of a decoder layer on CPU: RMSNorm, and rotary embedding in place. Built by cpu_row_ops.py with
// torch's cpp_extension; rows are split over torch's own thread pool.
//
// Compiled with -ffp-contract=off: a*b - c*d stays two rounded products and a rounded difference, as torch's
// separate mul and sub compute it, so the rotation is bit for bit the torch one. The norm's sum of squares runs in
// another order than torch's reduction (last-bit differences in the mean).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrainValues = 16384;  // values a thread's task handles at least: short batches run inline

inline float sum_of_squares(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += x[i + j] * x[i + j];
  for (int64_t j = 0; i < n; ++i, ++j) lanes[j] += x[i] * x[i];
  float total = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

// out = x * rsqrt(mean(x²) + eps) * weight, rsqrt as torch's CPU kernel computes it (1 / sqrt)
inline void normalize_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inverse = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * weight[i];
}


int64_t row_grain(int64_t values_per_row) {
  return std::max<int64_t>(1, kGrainValues / std::max<int64_t>(1, values_per_row));
}

// x [..., Hd] -> x * rsqrt(mean(x²) + eps) * weight over each row of Hd values
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu(),
              "rms_norm: x must be a contiguous fp32 CPU tensor [..., Hd]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              "rms_norm: weight must be a contiguous fp32 tensor [Hd]");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const float* x_data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) normalize_row(x_data + t * n, w, static_cast<float>(eps), n, o + t * n);
  });
  return out;
}

// Rotates the leading r = 2 * cos.size(1) dims of each head of x [T, H, D] in place by cos/sin [T, r/2]: pairs
// (i, i + r/2) (neox) or (2i, 2i + 1) (interleaved); x's heads may sit at any stride, each head's dims contiguous.
void rotate_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(),
              "rotate_: x must be an fp32 CPU tensor [T, H, D] with contiguous head dims");
  const int64_t tokens = x.size(0), heads = x.size(1), half = cos.size(1);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(0) == tokens && table->size(1) == half,
                "rotate_: cos and sin must be contiguous fp32 tensors [T, r/2]");
  TORCH_CHECK(2 * half <= x.size(2), "rotate_: ", 2 * half, " rotary dims exceed the head dim ", x.size(2));
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* data = x.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  const int64_t first_step = interleaved ? 2 : 1, second_offset = interleaved ? 1 : half;
  at::parallel_for(0, tokens, row_grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_data + t * half;
      const float* s = sin_data + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* head = data + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          float* first = head + i * first_step;
          float* second = first + second_offset;
          const float a = *first, b = *second;
          *first = a * c[i] - b * s[i];
          *second = b * c[i] + a * s[i];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(nebula_rows, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotate_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved) -> ()");
}

TORCH_LIBRARY_IMPL(nebula_rows, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotate_", rotate_);
}
