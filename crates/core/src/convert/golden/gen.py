# Golden vectors of torch's CPU casts, for the tests of src/convert/cast.rs and fp8.rs.
# Run from the repository root with torch installed: python src/convert/golden/gen.py
# f32.txt: f32 bits, then torch's bf16, f16, float8_e4m3fn and float8_e5m2 bits.
# f64.txt: f64 bits, then torch's f32, bf16 and f16 bits.
import torch, struct, random
random.seed(14)
def f32b(x): return struct.unpack('<I', struct.pack('<f', x))[0]
pats = set()
# ties and neighbours for bf16 (16 dropped bits) and f16 (13 dropped bits, normal range)
for base in [0x3f800000, 0x3f810000, 0x47000000, 0x00010000, 0x00000000, 0x7f7f0000, 0x477fe000, 0x38800000, 0x33000000, 0x33800000, 0x387fc000]:
    for low in [0x8000, 0x7fff, 0x8001, 0x18000, 0x1000, 0xfff, 0x1001, 0x3000, 0x2000, 0x1fff, 0x2001, 1, 0xffff]:
        pats.add((base + low) & 0xffffffff)
# f16 subnormal ties: spacing 2^-24
for k in range(1, 40):
    for off in [-1, 0, 1]:
        x = (k + 0.5) * 2.0**-24
        pats.add(f32b(x) + off)
# fp8 ties: e4m3 spacing near 1 is 1/8, subnormal 2^-9; e5m2 near 1 is 1/4, sub 2^-16
for k in range(0, 64):
    for sp in [2.0**-9, 2.0**-16, 1/8, 1/4, 2.0**-6 / 8, 32.0, 4096.0]:
        x = (k + 0.5) * sp
        for off in [-1, 0, 1]:
            pats.add(f32b(x) + off)
# saturation boundaries
for x in [448, 464, 479.99, 480, 481, 500, 57344, 61439, 61440, 65504, 65519.99, 65520, 1e9, 3.4e38]:
    pats.add(f32b(x))
# specials
pats |= {0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fbfffff, 0x7fe01234, 0xffa00000, 0x80000000, 0x00000001, 0x807fffff, 0x00800000}
for _ in range(300):
    pats.add(random.getrandbits(32))
pats = sorted(p & 0xffffffff for p in pats)
neg = [p | 0x80000000 for p in pats[:200]]
pats = sorted(set(pats + neg))
t = torch.tensor(pats, dtype=torch.int64).to(torch.int32).view(torch.float32)
def bits(x, n):
    return [v & ((1 << n) - 1) for v in x.view({8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[n]).tolist()]
bf = bits(t.to(torch.bfloat16), 16); hf = bits(t.to(torch.float16), 16)
e4 = bits(t.to(torch.float8_e4m3fn), 8); e5 = bits(t.to(torch.float8_e5m2), 8)
with open('src/convert/golden/f32.txt', 'w') as f:
    for row in zip(pats, bf, hf, e4, e5):
        f.write('%08x %04x %04x %02x %02x\n' % row)
# f64 inputs
d = set()
for x in [1+2**-8+2**-40, 1+2**-11+2**-40, 1+2**-24+2**-60, 1+2**-24, 1e-310, 2**-1074, 3.5e38, 1e300, 65520 - 2**-30, 2**-25 + 2**-60]:
    d.add(struct.unpack('<Q', struct.pack('<d', x))[0]); d.add(struct.unpack('<Q', struct.pack('<d', -x))[0])
d |= {0x7ff0000000000000, 0x7ff8000000000000, 0xfff8000000000000, 0x7ff4000000000001, 0x7ff8123456789abc}
for _ in range(150):
    e = random.randint(1023 - 30, 1023 + 20)
    d.add((random.getrandbits(1) << 63) | (e << 52) | random.getrandbits(52))
    d.add((e << 52) | (random.getrandbits(23) << 29) | (1 << 28))  # f32 ties
d = sorted(d)
t = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in d], dtype=torch.int64).view(torch.float64)
f = bits(t.to(torch.float32), 32); bf = bits(t.to(torch.bfloat16), 16); hf = bits(t.to(torch.float16), 16)
with open('src/convert/golden/f64.txt', 'w') as o:
    for row in zip(d, f, bf, hf):
        o.write('%016x %08x %04x %04x\n' % row)
print(torch.__version__, len(pats), len(d))
