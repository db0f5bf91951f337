// Presets for pacer plan: published model shapes and GPU figures, each with where it comes from. docs/plan.md
// ("Presets") has the same table with the citations; tests/plan/test_presets.cpp checks the parameter counts
// against the counts the sources state.
#include <fmt/format.h>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

// The block of Llama 3 and its descendants: grouped-query attention, SwiGLU, no biases, RMSNorm, rotary
// positions, untied output layer, no dropout.
Model llama_block(int layers, int hidden, int heads, int kv_heads, int ffn, int vocab, int seq) {
  return Model{.layers = layers, .hidden = hidden, .heads = heads, .seq = seq, .vocab = vocab, .ffn = ffn,
               .kv_heads = kv_heads, .gated_mlp = true, .biases = false, .rms_norm = true,
               .learned_positions = false, .tied_embeddings = false, .dropout = false};
}

// Apertus: the Llama block with a non-gated xIELU MLP (an element-wise activation like GeLU). Its QK-norm
// (2 x 128 weights per layer) is left out.
Model apertus_block(int layers, int hidden, int heads, int kv_heads, int ffn) {
  Model m = llama_block(layers, hidden, heads, kv_heads, ffn, 131072, 4096);
  m.gated_mlp = false;
  return m;
}

std::vector<ModelPreset> make_models() {
  std::vector<ModelPreset> v;
  // Megatron pads the vocabulary to 128 x tp 8: the 51200 of the Megatron papers.
  const Model gpt3{.layers = 96, .hidden = 12288, .heads = 96, .seq = 2048, .vocab = 50257, .vocab_multiple = 1024};
  v.push_back({"gpt3-175b", gpt3, "Brown et al. 2020 (arXiv:2005.14165) Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048; GPT-2 BPE vocabulary 50257", 175e9});
  v.push_back({"llama3-8b", llama_block(32, 4096, 32, 8, 14336, 128256, 8192),
               "Llama 3 Herd of Models (arXiv:2407.21783) Table 3: 32 layers, 4096, FFN 14336, 32 heads, 8 KV heads, vocabulary 128K (128256 in the released config), seq 8192", 8.03e9});
  v.push_back({"llama3-70b", llama_block(80, 8192, 64, 8, 28672, 128256, 8192),
               "Llama 3 Herd of Models (arXiv:2407.21783) Table 3: 80 layers, 8192, FFN 28672, 64 heads, 8 KV heads, seq 8192", 70.6e9});
  v.push_back({"llama3-405b", llama_block(126, 16384, 128, 8, 53248, 128256, 8192),
               "Llama 3 Herd of Models (arXiv:2407.21783) Table 3: 126 layers, 16384, FFN 53248, 128 heads, 8 KV heads, seq 8192", 405e9});
  v.push_back({"apertus-8b", apertus_block(32, 4096, 32, 8, 21504),
               "swiss-ai Apertus-8B config.json: 32 layers, 4096, xIELU MLP 21504, 32 heads, 8 KV heads, vocabulary 131072, untied; pre-training seq 4096", 0});
  v.push_back({"apertus-70b", apertus_block(80, 8192, 64, 8, 43008),
               "swiss-ai Apertus-70B config.json: 80 layers, 8192, xIELU MLP 43008, 64 heads, 8 KV heads, vocabulary 131072, untied; pre-training seq 4096 on 4096 GH200s (the seeds' model)", 0});
  // Nemotron-4: grouped-query attention, rotary positions, no biases, untied, with LayerNorm and a squared-ReLU
  // (not gated) MLP.
  Model nemotron = llama_block(96, 18432, 96, 8, 73728, 256000, 4096);
  nemotron.gated_mlp = false;
  nemotron.rms_norm = false;
  v.push_back({"nemotron4-340b", nemotron,
               "NVIDIA NeMo-Framework-Launcher conf/training/nemotron/nemotron_340b.yaml: 96 layers, 18432, squared-ReLU MLP 4 x 18432, 96 heads, 8 query groups, LayerNorm, no biases, untied, seq 4096; vocabulary 256000 (NVIDIA dgxc-benchmarking nemotron/README_340b.md); Nemotron-4 340B Technical Report (arXiv:2406.11704)", 340e9});
  Model mixtral = llama_block(32, 4096, 32, 8, 14336, 32000, 4096);
  mixtral.experts = 8;
  mixtral.top_k = 2;
  v.push_back({"mixtral-8x7b", mixtral,
               "Jiang et al. 2024, Mixtral of Experts (arXiv:2401.04088) Table 1: 32 layers, 4096, FFN 14336, 32 heads, 8 KV heads, 8 experts, top-2, vocabulary 32000; 46.7B parameters (Mistral AI, 2023-12-11)", 46.7e9});
  Model ds = llama_block(28, 2048, 16, 16, 10944, 102400, 4096);
  ds.experts = 64;
  ds.top_k = 6;
  ds.expert_ffn = 1408;
  ds.shared_experts = 2;
  ds.dense_layers = 1;
  v.push_back({"deepseek-moe-16b", ds,
               "Dai et al. 2024, DeepSeekMoE (arXiv:2401.06066) §5 and the released config: 28 layers, 2048, 16 heads, first layer dense (FFN 10944), 64 routed experts of 1408 + 2 shared, top-6, vocabulary 102400; 16.4B parameters", 16.4e9});
  return v;
}

// One GEMM constant per generation, never fitted per row (docs/plan.md, "GPU presets"):
//   Ampere: 226.0 TFLOP/s, the calibrated constant of the A100 validation (72.4% of 312);
//   Hopper: 700.8 TFLOP/s, `pacer vet` gpu.sustained_tflops over 30 s on the slower of two H200s
//     (bench/results/multi-gpu-h200x2-2026-11-29/vet-gpu.json), 70.8% of 989.4;
//   Blackwell: not measured; Hopper's 70.8% share of its 2250 TFLOP/s peak, an assumption.
// HBM: the Ampere validation's 80% of the datasheet; Hopper and Blackwell 89%, what vet measured on the H200
// (4266.6 of 4800 GB/s). NVLink bus bandwidth: 230 GB/s on A100 (the validation), 325 GB/s on Hopper (vet's
// gpu.nccl_busbw on the H200 pair), Blackwell Hopper's share of NVLink 5's doubled per-direction rate.
// Network: 90% of the NIC rate per GPU (HDR 200 Gb/s on DGX A100, NDR 400 Gb/s on H100/H200/B200 systems,
// Slingshot-11 200 Gb/s per GH200 on Alps).
// Fused attention, Hopper: cuDNN's kernel at head size 128 ran forward and backward in 1.68 times the GEMM-rate
// time at 661.9 TFLOP/s on the H200 (bench/results/attention_roofline-h200-2026-11-29.json): 395 TFLOP/s.
// Ampere keeps the validation's (no fused kernel in those runs); Blackwell scales Hopper's share of the peak.
// FlashAttention-2, Hopper: the same measurement of torch's FLASH_ATTENTION backend (FlashAttention-2, the kernel
// Transformer Engine runs with NVTE_FUSED_ATTN=0), 2.89 times the GEMM-rate time: 229 TFLOP/s. It was written for
// Ampere and uses none of Hopper's asynchronous tensor-core instructions, hence the gap to cuDNN. Measured on Hopper
// only: no figure for the other generations.
constexpr double kHopperGemm = 700.8, kHopperPeak = 989.4, kHopperAttention = 661.9 / 1.677;
constexpr double kHopperFlash2Attention = 661.9 / 2.889;
constexpr double kHopperHbmShare = 4266.6 / 4800;

Hardware gpu(double peak, double gemm, double hbm, double tp, double dp, int per_node, double attention = 0) {
  return Hardware{.gemm_tflops = gemm, .gpus_per_node = per_node, .attention_tflops = attention, .peak_tflops = peak,
                  .hbm_gbps = hbm, .tp_gbps = tp, .dp_gbps = dp};
}

std::vector<GpuPreset> make_gpus() {
  constexpr double GiB = 1073741824.0;
  return {
      {"a100-80g", gpu(312, 226.0, 0.8 * 2039, 230, 0.9 * 25, 8), 80 * GiB,
       "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80GB HBM2e at 2039 GB/s, NVLink 3 600 GB/s; DGX A100: one 200 Gb/s HDR adapter per GPU"},
      {"h100-sxm", gpu(kHopperPeak, kHopperGemm, kHopperHbmShare * 3350, 325, 0.9 * 50, 8, kHopperAttention), 80 * GiB,
       "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16 (1979 sparse), 80GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s; DGX H100: one 400 Gb/s NDR adapter per GPU", kHopperFlash2Attention},
      {"h200", gpu(kHopperPeak, kHopperGemm, kHopperHbmShare * 4800, 325, 0.9 * 50, 8, kHopperAttention), 141e9,
       "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 141GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s; HGX H200: one 400 Gb/s adapter per GPU", kHopperFlash2Attention},
      {"gh200", gpu(kHopperPeak, kHopperGemm, kHopperHbmShare * 4000, 325, 0.9 * 25, 4, kHopperAttention), 96e9,
       "NVIDIA GH200 datasheet (96GB HBM3 at 4 TB/s, the Hopper GPU's 989 TFLOP/s); CSCS Alps: 4 GH200 per node over NVLink, one 200 Gb/s Slingshot-11 NIC per GH200", kHopperFlash2Attention},
      {"b200", gpu(2250, kHopperGemm / kHopperPeak * 2250, kHopperHbmShare * 8000, 325.0 * 2, 0.9 * 50, 8, kHopperAttention / kHopperPeak * 2250), 180e9,
       "NVIDIA HGX B200: 2250 TFLOP/s dense BF16 (4500 sparse), 180GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s; one 400 Gb/s adapter per GPU"},
  };
}

template <typename T>
Expected<T> find(const std::vector<T>& v, const std::string& name, const char* option) {
  std::string names;
  for (const auto& p : v) {
    if (p.name == name) return p;
    names += (names.empty() ? "" : ", ") + p.name;
  }
  return Error{ErrorKind::kUsage, fmt::format("{} '{}': no such preset (known: {})", option, name, names)};
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> v = make_models();
  return v;
}

const std::vector<GpuPreset>& gpu_presets() {
  static const std::vector<GpuPreset> v = make_gpus();
  return v;
}

Expected<ModelPreset> find_model_preset(const std::string& name) { return find(model_presets(), name, "--model"); }
Expected<GpuPreset> find_gpu_preset(const std::string& name) { return find(gpu_presets(), name, "--gpu"); }

}  // namespace pacer::plan
