// What `--flash-attn auto` resolves to (kv_cache_type.h resolve_flash_attn): on with a quantized
// cache, llama.cpp's own choice with layers on a GPU, on with --speculative auto, on for a model
// file under 512 MiB or one with hybrid or sliding-window layers; otherwise off up to a 1 GiB attention matrix (512 queries x the slot's
// cells x the query heads x 4 bytes), on past it. `on` and `off` as given.
// trioserve/worker/model_cost.py mirrors the rule; tests/unit/worker/test_model_cost.py checks
// the same boundaries there.
#include "check.h"
#include "kv_cache_type.h"

using namespace trioserve;

namespace {

constexpr uint64_t kBig = uint64_t{900} << 20;  // a 1.5B-class Q4_K_M file

FlashAttnMode cpu_auto(int64_t n_head, int64_t cells, uint64_t file_bytes = kBig, bool full_attention_only = true) {
    return resolve_flash_attn(FlashAttnMode::automatic,
                              {KvCacheType::f16, 0, false, file_bytes, full_attention_only, n_head, cells});
}

}  // namespace

int main() {
    using M = FlashAttnMode;
    // 12 query heads: 43,690 cells fit 1 GiB, 43,691 do not.
    CHECK(cpu_auto(12, 25'600) == M::off);
    CHECK(cpu_auto(12, 43'690) == M::off);
    CHECK(cpu_auto(12, 43'691) == M::on);
    // Exactly 1 GiB (8 heads x 65,536 cells) is still off.
    CHECK_EQ(uint64_t{4} * 8 * 512 * 65'536, kAutoFlashAttnOffMaxBytes);
    CHECK(cpu_auto(8, 65'536) == M::off);
    CHECK(cpu_auto(8, 65'537) == M::on);
    // A model file under 512 MiB keeps it; from 512 MiB on, off.
    CHECK(cpu_auto(9, 8'192, kAutoFlashAttnOffMinModelBytes - 1) == M::on);
    CHECK(cpu_auto(9, 8'192, kAutoFlashAttnOffMinModelBytes) == M::off);
    CHECK(cpu_auto(9, 8'192, 0) == M::on);  // a file that could not be read: llama.cpp's default
    // A hybrid or sliding-window model keeps it, whatever its size.
    CHECK(cpu_auto(16, 8'192, kBig * 2, false) == M::on);
    // A quantized cache needs flash attention; a GPU leaves it to llama.cpp.
    CHECK(resolve_flash_attn(M::automatic, {KvCacheType::q8_0, 0, false, kBig, true, 12, 4'096}) == M::on);
    CHECK(resolve_flash_attn(M::automatic, {KvCacheType::q4_0, 99, false, kBig, true, 12, 4'096}) == M::on);
    CHECK(resolve_flash_attn(M::automatic, {KvCacheType::f16, 99, false, kBig, true, 12, 4'096}) == M::automatic);
    CHECK(resolve_flash_attn(M::automatic, {KvCacheType::f16, -1, true, kBig, true, 12, 4'096}) == M::automatic);
    // --speculative auto on a CPU: on (a verify step is exact only with it), at any context.
    CHECK(resolve_flash_attn(M::automatic, {KvCacheType::f16, 0, true, kBig, true, 12, 4'096}) == M::on);
    // Given settings stay as given, whatever the model and context.
    CHECK(resolve_flash_attn(M::on, {KvCacheType::f16, 0, false, kBig, true, 12, 4'096}) == M::on);
    CHECK(resolve_flash_attn(M::off, {KvCacheType::f16, 0, true, 1, false, 64, 1'000'000}) == M::off);
    CHECK(std::string(flash_attn_mode_name(M::automatic)) == "auto");
    FlashAttnMode parsed = M::automatic;
    CHECK(parse_flash_attn_mode(flash_attn_mode_name(M::off), parsed) && parsed == M::off);
    return trioserve_test::finish("flash_attn_choice");
}
