// rans.cu: chunked static rANS of small-alphabet symbols (hvdcomp/ops/rans.py).
//
// The specification is hvdcomp/ops/rans.py (the references of encode_symbols and
// decode_symbols): 32-bit state in [2^16, 2^32), 16-bit renormalization,
// probability precision P = 15, chunks of C symbols coded independently.  These kernels
// produce and consume exactly its bytes for alphabets of at most 256 symbols.
//
// Symbols are read from / written to "packed codes": symbol i occupies bits [i*BITS,
// (i+1)*BITS) of an LSB-first byte stream (hvdcomp/ops/bitpack.py), BITS in 1..8.  With
// BITS = 8 that is a plain uint8 array of symbols.  So the quantizers' packed kernel output
// feeds the encoder directly, and the decoder's output feeds hvd_dequantize_add.
//
// Kernels (launch geometry, argument checks, the Python glue between launches:
// hvdcomp/ops/rans.py):
//   hvd_rans_histogram   one thread per segment of `seg` symbols (seg a multiple of 8): that
//                        segment's symbol counts, 2^BITS u32 bins, into partial[s][.]
//                        (summed over segments, in int64, by the launcher: exact, so the
//                        histogram is deterministic).
//   hvd_rans_encode      one thread per chunk: the chunk's symbols, last to first; the u16
//                        words it emits go to the END of the chunk's worst-case slot (one word
//                        per symbol at most), so the chunk's stream in read order is the
//                        slot's last counts[k] words; its final state goes to states[k].
//   hvd_rans_gather      one thread per 16 output bytes of the chunk-stream region: each byte
//                        found from the exclusive prefix sum of the chunk lengths (4 + 2 *
//                        counts) by binary search: u32 final state, then the words.
//   hvd_rans_slot_table  one thread per slot of 2^P: the symbol whose [cum, cum + freq) holds
//                        the slot (np.repeat(arange(A), freq) of the reference).
//   hvd_rans_decode      one thread per chunk: offsets[k] (the chunk's byte offset in the
//                        section, from the chunk table) to the chunk's symbols, one byte
//                        each; status[k] = 0 ok, 1 initial state below 2^16, 2 the chunk ran
//                        out of words, 3 it did not end in the state 2^16 or left words
//                        unread (the reference's three errors, in its priority).
//   hvd_rans_pack        one thread per group of 8 symbols: uint8 symbols to packed codes.
//
// freqcum: u32 (2 * 2^BITS,): freq[s] at [2s], cum[s] at [2s + 1] (absent symbols: freq 0).
#include "hvdcomp.cuh"

namespace hvd_rans {

using hvd::i64;
using hvd::u32;
using hvd::u64;

constexpr u32 kPrec = 15;
constexpr u32 kLow = 1u << 16;   // lower bound of the state

// Symbol i of a packed stream at BITS bits (the bytes it touches exist).
template <int BITS>
__device__ __forceinline__ u32 get_sym(const unsigned char* __restrict__ p, i64 i) {
  if (BITS == 8) return p[i];
  const i64 bit = i * BITS;
  const i64 byte = bit >> 3;
  const int sh = (int)(bit & 7);
  u32 v = p[byte];
  if (sh + BITS > 8) v |= (u32)p[byte + 1] << 8;
  return (v >> sh) & ((1u << BITS) - 1u);
}

// ---- histogram -------------------------------------------------------------------------------

template <int BITS>
__device__ inline void histogram_segment(const unsigned char* __restrict__ packed, i64 n,
                                         i64 seg, i64 s, u32* __restrict__ partial) {
  constexpr int NB = 1 << BITS;
  u32 h[4][NB];
  for (int j = 0; j < 4; ++j)
    for (int b = 0; b < NB; ++b) h[j][b] = 0;
  const i64 lo = s * seg;
  const i64 hi = hvd::min64(n, lo + seg);
  const i64 nbytes = (n * BITS + 7) >> 3;
  i64 i = lo;
  // whole groups of 8 codes (BITS bytes): seg is a multiple of 8, so lo is a group start
  for (; i + 8 <= hi; i += 8) {
    const u64 w = hvd::load_group<BITS>(packed, i >> 3, nbytes);
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) h[k & 3][(w >> (k * BITS)) & (NB - 1)] += 1;
  }
  for (; i < hi; ++i) h[0][get_sym<BITS>(packed, i)] += 1;
  for (int b = 0; b < NB; ++b) partial[s * NB + b] = (h[0][b] + h[1][b]) + (h[2][b] + h[3][b]);
}

template <int BITS>
__device__ inline void histogram_all(const unsigned char* packed, i64 n, i64 seg,
                                     u32* partial) {
  const i64 nseg = (n + seg - 1) / seg;
  for (i64 s = hvd::global_thread(); s < nseg; s += hvd::grid_threads())
    histogram_segment<BITS>(packed, n, seg, s, partial);
}

// ---- encoder ---------------------------------------------------------------------------------

template <int BITS>
__device__ inline void encode_chunk(const unsigned char* __restrict__ packed, i64 n, i64 C,
                                    i64 slot_size, i64 k, const u32* __restrict__ freqcum,
                                    unsigned short* __restrict__ slots,
                                    u32* __restrict__ states, i64* __restrict__ counts) {
  const i64 lo = k * C;
  const i64 hi = hvd::min64(n, lo + C);
  unsigned short* __restrict__ end = slots + k * slot_size + slot_size;  // one past the slot
  u32 x = kLow;
  i64 cnt = 0;
  for (i64 i = hi - 1; i >= lo; --i) {
    const u32 s = get_sym<BITS>(packed, i);
    const u32 f = freqcum[2 * s];
    const u32 c = freqcum[2 * s + 1];
    if ((u64)x >= ((u64)f << (32 - kPrec))) {
      ++cnt;
      end[-cnt] = (unsigned short)(x & 0xFFFFu);
      x >>= 16;
    }
    // x < f * 2^17 here, so x / f < 2^17 and the result stays below 2^32
    x = ((x / f) << kPrec) + (x % f) + c;
  }
  states[k] = x;
  counts[k] = cnt;
}

template <int BITS>
__device__ inline void encode_all(const unsigned char* packed, i64 n, i64 C, i64 K,
                                  i64 slot_size, const u32* freqcum, unsigned short* slots,
                                  u32* states, i64* counts) {
  for (i64 k = hvd::global_thread(); k < K; k += hvd::grid_threads())
    encode_chunk<BITS>(packed, n, C, slot_size, k, freqcum, slots, states, counts);
}

// ---- gather: the chunk streams in the reference's layout --------------------------------------

constexpr i64 kGatherBytes = 16;

__device__ inline void gather_group(const unsigned short* __restrict__ slots,
                                    const u32* __restrict__ states,
                                    const i64* __restrict__ counts,
                                    const i64* __restrict__ offsets, i64 K, i64 slot_size,
                                    unsigned char* __restrict__ out, i64 total, i64 g) {
  const i64 p0 = g * kGatherBytes;
  const i64 p1 = hvd::min64(total, p0 + kGatherBytes);
  // the last chunk k with offsets[k] <= p0 (offsets[0] = 0, offsets[K] = total)
  i64 a = 0, b = K - 1;
  while (a < b) {
    const i64 mid = (a + b + 1) >> 1;
    if (offsets[mid] <= p0) a = mid; else b = mid - 1;
  }
  i64 k = a;
  for (i64 p = p0; p < p1; ++p) {
    while (p >= offsets[k + 1]) ++k;
    const i64 local = p - offsets[k];
    unsigned char v;
    if (local < 4) {
      v = (unsigned char)(states[k] >> (8 * local));
    } else {
      const i64 w = (local - 4) >> 1;
      const unsigned short word = slots[k * slot_size + slot_size - counts[k] + w];
      v = (unsigned char)(((local - 4) & 1) ? (word >> 8) : (word & 0xFF));
    }
    out[p] = v;
  }
}

// ---- decoder ---------------------------------------------------------------------------------

__device__ inline void slot_symbol(const u32* __restrict__ freqcum, int A, i64 slot,
                                   unsigned char* __restrict__ table) {
  // the last s with cum[s] <= slot: absent symbols (freq 0) share their successor's cum
  int a = 0, b = A - 1;
  while (a < b) {
    const int mid = (a + b + 1) >> 1;
    if ((i64)freqcum[2 * mid + 1] <= slot) a = mid; else b = mid - 1;
  }
  table[slot] = (unsigned char)a;
}

__device__ __forceinline__ u32 read_u16(const unsigned char* __restrict__ p) {
  return (u32)p[0] | ((u32)p[1] << 8);
}

__device__ inline void decode_chunk(const unsigned char* __restrict__ sec,
                                    const i64* __restrict__ offsets, i64 C, i64 n, i64 k,
                                    const unsigned char* __restrict__ table,
                                    const u32* __restrict__ freqcum,
                                    unsigned char* __restrict__ out, int* __restrict__ status) {
  const unsigned char* __restrict__ s0 = sec + offsets[k];
  const i64 nwords = (offsets[k + 1] - offsets[k] - 4) >> 1;
  u32 x = (u32)s0[0] | ((u32)s0[1] << 8) | ((u32)s0[2] << 16) | ((u32)s0[3] << 24);
  if (x < kLow) {
    status[k] = 1;
    return;
  }
  const unsigned char* __restrict__ w = s0 + 4;
  i64 ptr = 0;
  const i64 lo = k * C;
  const i64 hi = hvd::min64(n, lo + C);
  const u32 mask = (1u << kPrec) - 1u;
  for (i64 i = lo; i < hi; ++i) {
    const u32 slot = x & mask;
    const u32 s = table[slot];
    out[i] = (unsigned char)s;
    // x < 2^32 and slot - cum < freq, so this stays below 2^32
    x = freqcum[2 * s] * (x >> kPrec) + slot - freqcum[2 * s + 1];
    if (x < kLow) {
      if (ptr >= nwords) {
        status[k] = 2;
        return;
      }
      x = (x << 16) | read_u16(w + 2 * ptr);
      ++ptr;
    }
  }
  status[k] = (x != kLow || ptr != nwords) ? 3 : 0;
}

template <int BITS>
__device__ inline void pack_group(const unsigned char* __restrict__ sym, i64 n, i64 g,
                                  unsigned char* __restrict__ out) {
  const i64 nbytes = (n * BITS + 7) >> 3;
  const i64 i0 = g * 8;
  u64 word = 0;
  if (i0 + 8 <= n) {
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) word |= (u64)sym[i0 + k] << (k * BITS);
  } else {
    for (int k = 0; (i64)k < n - i0; ++k) word |= (u64)sym[i0 + k] << (k * BITS);
  }
  hvd::store_group<BITS>(out, g, nbytes, word);
}

template <int BITS>
__device__ inline void pack_all(const unsigned char* sym, i64 n, unsigned char* out) {
  const i64 ng = (n + 7) >> 3;
  for (i64 g = hvd::global_thread(); g < ng; g += hvd::grid_threads())
    pack_group<BITS>(sym, n, g, out);
}

}  // namespace hvd_rans

#define HVD_RANS_DISPATCH(bits, CALL)            \
  switch (bits) {                                 \
    case 1: CALL(1); break;                       \
    case 2: CALL(2); break;                       \
    case 3: CALL(3); break;                       \
    case 4: CALL(4); break;                       \
    case 5: CALL(5); break;                       \
    case 6: CALL(6); break;                       \
    case 7: CALL(7); break;                       \
    case 8: CALL(8); break;                       \
    default: hvd::bad_launch("rans: bits must be in 1..8"); \
  }

// partial: u32 (ceil(n / seg) * 2^bits,); seg: a multiple of 8.
extern "C" __global__ void hvd_rans_histogram(const unsigned char* __restrict__ packed,
                                              long long n, int bits, long long seg,
                                              unsigned int* __restrict__ partial) {
  if (seg <= 0 || (seg & 7) != 0) {
    hvd::bad_launch("hvd_rans_histogram: seg must be a positive multiple of 8");
    return;
  }
#define HVD_RANS_HIST(B) hvd_rans::histogram_all<B>(packed, n, seg, partial)
  HVD_RANS_DISPATCH(bits, HVD_RANS_HIST)
#undef HVD_RANS_HIST
}

// slots: u16 (K * slot_size,), slot_size >= the longest chunk; states u32 (K,); counts i64 (K,).
extern "C" __global__ void hvd_rans_encode(const unsigned char* __restrict__ packed,
                                           long long n, int bits, long long C, long long K,
                                           long long slot_size,
                                           const unsigned int* __restrict__ freqcum,
                                           unsigned short* __restrict__ slots,
                                           unsigned int* __restrict__ states,
                                           long long* __restrict__ counts) {
#define HVD_RANS_ENC(B) \
  hvd_rans::encode_all<B>(packed, n, C, K, slot_size, freqcum, slots, states, counts)
  HVD_RANS_DISPATCH(bits, HVD_RANS_ENC)
#undef HVD_RANS_ENC
}

// offsets: i64 (K + 1,), exclusive prefix sum of the chunk lengths 4 + 2 * counts[k];
// out: the `total` = offsets[K] bytes of the chunk streams.
extern "C" __global__ void hvd_rans_gather(const unsigned short* __restrict__ slots,
                                           const unsigned int* __restrict__ states,
                                           const long long* __restrict__ counts,
                                           const long long* __restrict__ offsets, long long K,
                                           long long slot_size, unsigned char* __restrict__ out,
                                           long long total) {
  const long long ng = (total + hvd_rans::kGatherBytes - 1) / hvd_rans::kGatherBytes;
  for (long long g = hvd::global_thread(); g < ng; g += hvd::grid_threads())
    hvd_rans::gather_group(slots, states, counts, offsets, K, slot_size, out, total, g);
}

// table: u8 (2^15,); A in 1..256; the model sums to 2^15 (checked by the launcher).
extern "C" __global__ void hvd_rans_slot_table(const unsigned int* __restrict__ freqcum, int A,
                                               unsigned char* __restrict__ table) {
  const long long nslots = 1LL << hvd_rans::kPrec;
  for (long long s = hvd::global_thread(); s < nslots; s += hvd::grid_threads())
    hvd_rans::slot_symbol(freqcum, A, s, table);
}

// sec: the whole section; offsets: i64 (K + 1,) byte offsets of the chunk streams in sec
// (lengths validated by the launcher: >= 4, even, ending at the section's end);
// out: u8 (n,) symbols; status: i32 (K,).
extern "C" __global__ void hvd_rans_decode(const unsigned char* __restrict__ sec,
                                           const long long* __restrict__ offsets, long long K,
                                           long long C, long long n,
                                           const unsigned char* __restrict__ table,
                                           const unsigned int* __restrict__ freqcum,
                                           unsigned char* __restrict__ out,
                                           int* __restrict__ status) {
  for (long long k = hvd::global_thread(); k < K; k += hvd::grid_threads())
    hvd_rans::decode_chunk(sec, offsets, C, n, k, table, freqcum, out, status);
}

// sym: u8 (n,) values < 2^bits; out: u8 (ceil(n * bits / 8),).
extern "C" __global__ void hvd_rans_pack(const unsigned char* __restrict__ sym, long long n,
                                         int bits, unsigned char* __restrict__ out) {
#define HVD_RANS_PACK(B) hvd_rans::pack_all<B>(sym, n, out)
  HVD_RANS_DISPATCH(bits, HVD_RANS_PACK)
#undef HVD_RANS_PACK
}
