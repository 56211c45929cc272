// What `--flash-attn auto` resolves to (kv_cache_type.h resolve_flash_attn): on with a quantized
// cache, llama.cpp's own choice with layers on a GPU, on with --speculative auto, and on a CPU
// otherwise off up to a 1 GiB attention matrix (512 queries x the slot's cells x the query
// heads x 4 bytes), on past it; `on` and `off` as given. trioserve/worker/model_cost.py mirrors the rule, and
// tests/unit/worker/test_model_cost.py checks the same boundary there.
#include "check.h"
#include "kv_cache_type.h"

using namespace trioserve;

int main() {
    using M = FlashAttnMode;
    const auto f16 = KvCacheType::f16;
    // 12 query heads (a 1.5B class): 43,690 cells fit 1 GiB, 43,691 do not.
    CHECK(resolve_flash_attn(M::automatic, f16, 0, false, 12, 25'600) == M::off);
    CHECK(resolve_flash_attn(M::automatic, f16, 0, false, 12, 43'690) == M::off);
    CHECK(resolve_flash_attn(M::automatic, f16, 0, false, 12, 43'691) == M::on);
    // Exactly 1 GiB (8 heads x 65,536 cells) is still off.
    CHECK_EQ(uint64_t{4} * 8 * 512 * 65'536, kAutoFlashAttnOffMaxBytes);
    CHECK(resolve_flash_attn(M::automatic, f16, 0, false, 8, 65'536) == M::off);
    CHECK(resolve_flash_attn(M::automatic, f16, 0, false, 8, 65'537) == M::on);
    // A quantized cache needs flash attention; a GPU leaves it to llama.cpp.
    CHECK(resolve_flash_attn(M::automatic, KvCacheType::q8_0, 0, false, 12, 4'096) == M::on);
    CHECK(resolve_flash_attn(M::automatic, KvCacheType::q4_0, 99, false, 12, 4'096) == M::on);
    CHECK(resolve_flash_attn(M::automatic, f16, 99, false, 12, 4'096) == M::automatic);
    CHECK(resolve_flash_attn(M::automatic, f16, -1, true, 12, 4'096) == M::automatic);
    // --speculative auto on a CPU: on (a verify step is exact only with it), at any context.
    CHECK(resolve_flash_attn(M::automatic, f16, 0, true, 12, 4'096) == M::on);
    CHECK(resolve_flash_attn(M::automatic, f16, 0, true, 12, 100'000) == M::on);
    // Given settings stay as given, whatever the context.
    CHECK(resolve_flash_attn(M::on, f16, 0, false, 12, 4'096) == M::on);
    CHECK(resolve_flash_attn(M::off, f16, 0, true, 64, 1'000'000) == M::off);
    CHECK(std::string(flash_attn_mode_name(M::automatic)) == "auto");
    FlashAttnMode parsed = M::automatic;
    CHECK(parse_flash_attn_mode(flash_attn_mode_name(M::off), parsed) && parsed == M::off);
    return trioserve_test::finish("flash_attn_choice");
}
