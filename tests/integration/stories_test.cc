// A real language model decodes through kvcd: stories260K (../shared/data/stories260K, a
// llama2.c checkpoint run by the llama worker) generates 100 tokens greedily from BOS with
// its attention served by the real daemon, with BF16, INT2 and FSQ history.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "daemon_process.h"
#include "examples/llama2c_tokenizer.h"
#include "examples/llama_worker.h"

namespace kvcd {
namespace stories_test {

using testing_util::DaemonProcess;

const std::string kData = std::string(KVCD_SHARED_DATA) + "/stories260K/";

// FSQ history, teacher-forced mean KL(FP32 || served) over 505 steps of held-out text,
// codecs initialized on another text (bench/results/2026-12-04-fsq-real-models.md):
// measured 0.0187 (G = 64), 0.105 (G = 32), 0.141 (G = 16); bounds: measured + 15%.
constexpr double kFsqG64MeanKl = 0.0215;
constexpr double kFsqG32MeanKl = 0.121;
constexpr double kFsqG16MeanKl = 0.163;

std::string CollapseSpaces(const std::string& s) {
  std::string out;
  bool space = false;
  for (char ch : s) {
    if (ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += ch;
  }
  return out;
}

// The check value: the "> " lines after "## Check value" in the data README.
std::string CheckValue() {
  std::ifstream in(kData + "README.md");
  std::string line, text;
  bool in_section = false;
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## Check value";
    if (in_section && line.rfind("> ", 0) == 0) text += line.substr(2) + "\n";
  }
  return CollapseSpaces(text);
}

class StoriesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::ifstream(kData + "stories260K.bin").good()) {
      GTEST_SKIP() << "no stories260K checkpoint at " << kData;
    }
    ASSERT_TRUE(
        daemon_.Start("listen: 127.0.0.1:0\nmetrics_listen: \"\"\nmemory_budget: 64MiB\n"
                      "drain_timeout_ms: 300\n"));
    ClientOptions o;
    o.target = daemon_.grpc();
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto m = llama::Model::LoadLlama2c(kData + "stories260K.bin");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::make_unique<llama::Model>(std::move(*m));
    auto t = llama::Llama2cTokenizer::Load(kData + "tok512.bin", model_->config().vocab_size);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::make_unique<llama::Llama2cTokenizer>(std::move(*t));
  }

  // The stories configuration: small windows so that a 100-token run has compressed
  // history (page 4, sink 4, recent 8).
  static llama::ServedProfile Profile(const std::string& name, const std::string& history,
                                      const std::string& codec = "") {
    llama::ServedProfile p;
    p.name = name;
    p.history = history;
    p.codec_blob = codec;
    p.page_size = 4;
    p.sink_tokens = 4;
    p.recent_tokens = 8;
    p.memory_bytes = 4 << 20;
    return p;
  }

  // A greedy FP32 run over positions 0 .. positions-1 from `text`, recorded.
  llama::Generation Greedy(const std::string& text, int positions, llama::LocalAttention* rec) {
    const std::vector<int> p = tok_->Encode(text);
    auto r = llama::RunReference(*model_, p, positions - static_cast<int>(p.size()) + 1, -1, rec);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : llama::Generation{};
  }

  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<llama::Model> model_;
  std::unique_ptr<llama::Llama2cTokenizer> tok_;
};

TEST_F(StoriesTest, Bf16HistoryReproducesTheCheckValue) {
  const std::string expected = CheckValue();
  ASSERT_GT(expected.size(), 100u);
  const std::vector<int> bos = {1};
  auto ref = llama::RunReference(*model_, bos, 100);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(CollapseSpaces(tok_->Decode(1, ref->tokens)), expected);  // the FP32 reference
  const llama::ServedProfile p = Profile("s-bf16", "bf16");
  ASSERT_TRUE(llama::RegisterProfile(*client_, model_->config(), p).ok());
  auto served = llama::RunServed(*client_, *model_, p, bos, 100);
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_EQ(served->logits.size(), 100u);
  EXPECT_EQ(CollapseSpaces(tok_->Decode(1, served->tokens)), expected);
  double max_kl = 0;
  for (size_t i = 0; i < served->logits.size(); ++i) {
    max_kl = std::max(max_kl, llama::KlDivergence(ref->logits[i], served->logits[i]));
  }
  EXPECT_LT(max_kl, 1e-3);  // measured 3.3e-4 (BF16 rounding of K/V)
}

TEST_F(StoriesTest, Int2HistoriesCompleteWithBoundedKl) {
  const std::vector<int> bos = {1};
  llama::LocalAttention calib(model_->config()), c2(model_->config()), c3(model_->config());
  auto ref = llama::RunReference(*model_, bos, 100, -1, &calib);
  ASSERT_TRUE(ref.ok());
  Greedy("Tom had a big dog", 64, &c2);
  Greedy("The sun was hot", 64, &c3);
  const std::string codec = llama::CalibrateOscarCodec(model_->config(), {&calib, &c2, &c3});
  // Mean KL(FP32 || served) of the next-token distributions, teacher-forced on the
  // reference tokens. Measured (head_dim 8, page 4, sink 4, recent 8): identity 1.98,
  // hadamard 1.96, calibrated OSCAR 1.57. Bounds: measured + ~15%.
  const struct {
    const char* format;
    double bound;
  } cases[] = {{"int2-identity", 2.3}, {"int2-hadamard", 2.3}, {"int2-oscar", 1.8}};
  double kl_identity = 0, kl_oscar = 0;
  for (const auto& c : cases) {
    const std::string name = std::string("s-") + c.format;
    const llama::ServedProfile p = Profile(name, c.format, codec);
    ASSERT_TRUE(llama::RegisterProfile(*client_, model_->config(), p).ok());
    auto run = llama::RunServed(*client_, *model_, p, bos, 100, -1, &ref->tokens);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->logits.size(), 100u);
    double mean = 0;
    for (size_t i = 0; i < run->logits.size(); ++i) {
      mean += llama::KlDivergence(ref->logits[i], run->logits[i]) / run->logits.size();
    }
    std::printf("%s: mean KL %.4f\n", c.format, mean);
    EXPECT_LT(mean, c.bound) << c.format;
    EXPECT_GT(mean, 1e-3) << c.format << ": INT2 history must differ from FP32";
    if (std::string(c.format) == "int2-identity") kl_identity = mean;
    if (std::string(c.format) == "int2-oscar") kl_oscar = mean;
  }
  EXPECT_LT(kl_oscar, kl_identity);  // calibrated rotations beat naive INT2 on this model
}

// FSQ history (docs/fsq.md) served by the daemon: codecs initialized in process
// (tools/fsq_calibration) on the model's residuals from one text (greedy from "Once upon a
// time", 512 positions), evaluated teacher-forced on another (greedy from "Tom had a big
// dog", 512 positions) at 4x, 8x and 16x of the dense K/V bytes (history codes: G = 64,
// 32, 16 -> 32, 16, 8 bytes per token per layer against 4 KV heads x 8 x K,V x BF16 =
// 128), beside INT2-OSCAR calibrated on the same text. Measured:
// bench/results/2026-12-04-fsq-real-models.md; bounds: measured + 15%.
TEST_F(StoriesTest, FsqHistoryTeacherForcedKlIsBounded) {
  const llama::Config& c = model_->config();
  llama::LocalAttention calib(c);
  Greedy("Once upon a time", 512, &calib);
  const std::vector<int> prompt = tok_->Encode("Tom had a big dog");
  auto ref = llama::RunReference(*model_, prompt, 512 - static_cast<int>(prompt.size()) + 1);
  ASSERT_TRUE(ref.ok());
  const struct {
    int g;
    double bound;
  } cases[] = {{64, kFsqG64MeanKl}, {32, kFsqG32MeanKl}, {16, kFsqG16MeanKl}};
  std::vector<double> means;
  for (const auto& k : cases) {
    auto blob = llama::InitializeFsqCodec(*model_, {&calib}, k.g);
    ASSERT_TRUE(blob.ok()) << blob.status();
    const llama::ServedProfile p = Profile(absl::StrCat("s-fsq", k.g), "fsq", *blob);
    auto info = llama::RegisterProfile(*client_, c, p);
    ASSERT_TRUE(info.ok()) << info.status();
    // The history stores only the codes: ceil(G/2) bytes per token per layer.
    EXPECT_DOUBLE_EQ(info->bytes_per_token_history(), c.n_layers * ((k.g + 1) / 2));
    EXPECT_DOUBLE_EQ(llama::DenseBytesPerToken(c) / info->bytes_per_token_history(), 256.0 / k.g);
    auto run = llama::RunServed(*client_, *model_, p, prompt, 0, -1, &ref->tokens);
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->logits.size(), ref->logits.size());
    const llama::Agreement a = llama::Compare(*ref, *run);
    std::printf("fsq G=%d: mean KL %.4f, max KL %.3f, first differs at step %d\n", k.g, a.mean_kl,
                a.max_kl, a.first_diff);
    EXPECT_LT(a.mean_kl, k.bound) << "G " << k.g;
    EXPECT_GT(a.mean_kl, 1e-4) << "G " << k.g << ": FSQ history must differ from FP32";
    means.push_back(a.mean_kl);
  }
  EXPECT_LT(means[0], means[2]);  // more latent coordinates, closer to FP32
  // INT2-OSCAR from the same calibration text, at 2.6x of the dense bytes.
  const llama::ServedProfile oscar =
      Profile("s-fsq-oscar", "int2-oscar", llama::CalibrateOscarCodec(c, {&calib}));
  ASSERT_TRUE(llama::RegisterProfile(*client_, c, oscar).ok());
  auto run = llama::RunServed(*client_, *model_, oscar, prompt, 0, -1, &ref->tokens);
  ASSERT_TRUE(run.ok()) << run.status();
  const double oscar_kl = llama::Compare(*ref, *run).mean_kl;
  std::printf("int2-oscar: mean KL %.4f\n", oscar_kl);
  EXPECT_LT(means[2], oscar_kl);  // FSQ at 16x beats INT2 at 2.6x on this model
}

// A codec file (as tools/fsq_finetune writes) is served the same as the codec built in
// process: `fsq=PATH` reads it, the daemon checks it, the run is identical.
TEST_F(StoriesTest, FsqCodecFileServesLikeTheInProcessCodec) {
  llama::LocalAttention calib(model_->config());
  Greedy("Once upon a time", 256, &calib);
  auto blob = llama::InitializeFsqCodec(*model_, {&calib}, 32);
  ASSERT_TRUE(blob.ok()) << blob.status();
  const std::string path = ::testing::TempDir() + "/stories-fsq32.safetensors";
  std::ofstream(path, std::ios::binary)
      .write(blob->data(), static_cast<std::streamsize>(blob->size()));
  auto from_file = llama::ResolveHistory("fsq=" + path, *model_, {});
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->history, "fsq");
  EXPECT_EQ(from_file->codec_blob, *blob);
  auto in_process = llama::ResolveHistory("fsq:G=32", *model_, {&calib});
  ASSERT_TRUE(in_process.ok()) << in_process.status();
  EXPECT_EQ(in_process->codec_blob, *blob);  // deterministic initialization
  EXPECT_EQ(llama::ResolveHistory("fsq:G=32", *model_, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // nothing to calibrate on
  EXPECT_EQ(llama::ResolveHistory("fsq=/nonexistent.st", *model_, {}).status().code(),
            absl::StatusCode::kNotFound);
  const std::vector<int> bos = {1};
  auto ref = llama::RunReference(*model_, bos, 100);
  ASSERT_TRUE(ref.ok());
  std::vector<std::vector<std::vector<float>>> logits;
  for (const auto* codec : {&from_file->codec_blob, &in_process->codec_blob}) {
    const llama::ServedProfile p =
        Profile(absl::StrCat("s-fsq-file", logits.size()), "fsq", *codec);
    ASSERT_TRUE(llama::RegisterProfile(*client_, model_->config(), p).ok());
    auto run = llama::RunServed(*client_, *model_, p, bos, 0, -1, &ref->tokens);
    ASSERT_TRUE(run.ok()) << run.status();
    logits.push_back(run->logits);
  }
  EXPECT_EQ(logits[0], logits[1]);
  EXPECT_EQ(llama::RegisterProfile(*client_, model_->config(),
                                   Profile("s-fsq-bad", "fsq", "not a safetensors file"))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace stories_test
}  // namespace kvcd
