// AMX tile support shared by the native kernels: the tile configuration and the tile data permission.
// Included where the build has the tile instructions (__AMX_TILE__ and __AMX_BF16__).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace optimum_qwen36::amx {

constexpr int64_t kRows = 16;    // rows of a tile
constexpr int64_t kValues = 32;  // bf16 values per tile row (64 bytes)

// The palette-1 tile configuration (Intel SDM, LDTILECFG): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes (16 float32 or 32 bf16), loaded for this thread until release().
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = uint8_t(kRows);
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

inline void release() { _tile_release(); }

// Linux hands the tile data (XTILEDATA) to a process only once it asks (arch_prctl, kernel 5.16+); without
// it the first tile instruction faults, so callers keep their vector paths.
inline bool granted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

}  // namespace optimum_qwen36::amx

#define QWEN36_AMX 1
#endif
