//! JPEG decoding with libjpeg-turbo's arithmetic, the decoder behind PIL's `Image.open`: the
//! "islow" integer IDCT (`jidctint.c`), "fancy" triangle-filter chroma upsampling (`jdsample.c`)
//! and fixed-point YCbCr to RGB (`jdcolor.c`), so that the RGB bytes equal PIL's
//! (docs/reference/images.md, "JPEG"). The `image` crate's decoder (zune-jpeg) rounds its
//! upsampling and colour conversion differently, up to several levels off on subsampled chroma.
//!
//! Covered: 8-bit baseline, extended-sequential and progressive Huffman JPEGs with one (grey) or
//! three (YCbCr or RGB) components and any integral sampling factors. Everything else (arithmetic
//! coding, 12-bit, lossless, CMYK, corrupt or truncated data, a progressive file whose scans leave
//! low-frequency coefficients unrefined, where libjpeg-turbo smooths blocks) returns `None`, and
//! the caller hands the file to the `image` crate as before.

use ::image::{DynamicImage, GrayImage, RgbImage};

use super::MAX_PIXELS;

/// Zigzag position to natural (row-major) position in an 8x8 block (ITU T.81, figure A.6).
const ZIGZAG: [usize; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

/// Decodes `data` to RGB8 (three components) or L8 (one), or `None` where the file is outside
/// what this module reproduces.
pub(super) fn decode(data: &[u8]) -> Option<DynamicImage> {
    let mut jpeg = Decoder::default();
    jpeg.read(data)?;
    jpeg.finish()
}

/// A canonical Huffman table (ITU T.81, annex C), decoded as `jdhuff.c` does: a lookup on the
/// first `FAST_BITS` bits, then code lengths one by one against `maxcode`.
struct Huffman {
    /// `symbol | length << 8` for codes of up to `FAST_BITS` bits, 0 where the code is longer.
    fast: [u16; 1 << FAST_BITS],
    /// The largest code of each length, -1 where there is none (`jdhuff.c`'s `maxcode`).
    maxcode: [i32; 17],
    /// Symbol index minus code for each length (`valoffset`).
    valoffset: [i32; 17],
    symbols: Vec<u8>,
}

const FAST_BITS: u32 = 9;

impl Huffman {
    fn new(counts: &[u8; 16], symbols: &[u8]) -> Option<Huffman> {
        let mut table = Huffman {
            fast: [0; 1 << FAST_BITS],
            maxcode: [-1; 17],
            valoffset: [0; 17],
            symbols: symbols.to_vec(),
        };
        let (mut code, mut k) = (0i32, 0usize);
        for (len, &count) in (1..=16u32).zip(counts) {
            let count = usize::from(count);
            // jdhuff.c's "bad Huffman table": more codes than the length allows.
            if code as usize + count > 1 << len {
                return None;
            }
            if count > 0 {
                table.valoffset[len as usize] = k as i32 - code;
                if len <= FAST_BITS {
                    for (i, &symbol) in symbols.get(k..k + count)?.iter().enumerate() {
                        let first = (code as usize + i) << (FAST_BITS - len);
                        let entry = u16::from(symbol) | (len as u16) << 8;
                        table.fast[first..first + (1 << (FAST_BITS - len))].fill(entry);
                    }
                }
                k += count;
                code += count as i32;
                table.maxcode[len as usize] = code - 1;
            }
            code <<= 1;
        }
        (k <= symbols.len()).then_some(table)
    }
}

/// The entropy-coded bits of a scan, MSB first, with `0xFF 0x00` unstuffed. At a marker it
/// supplies zero bits, as `jdhuff.c` does, and counts them: a scan that consumes any is corrupt.
struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    count: u32,
    /// Zero bits appended after a marker or the end of the data.
    padding: u32,
}

impl<'a> Bits<'a> {
    fn new(data: &'a [u8], pos: usize) -> Bits<'a> {
        Bits {
            data,
            pos,
            acc: 0,
            count: 0,
            padding: 0,
        }
    }

    /// The next data byte, or `None` at a marker or the end of the data.
    fn next_byte(&mut self) -> Option<u8> {
        let byte = *self.data.get(self.pos)?;
        if byte != 0xFF {
            self.pos += 1;
            return Some(byte);
        }
        // 0xFF 0x00 is a stuffed 0xFF data byte (T.81, F.1.2.3); any other 0xFF starts a marker.
        (self.data.get(self.pos + 1) == Some(&0)).then(|| {
            self.pos += 2;
            0xFF
        })
    }

    fn fill(&mut self) {
        while self.count <= 56 {
            let byte = if self.padding > 0 {
                None
            } else {
                self.next_byte()
            };
            if byte.is_none() {
                self.padding += 8;
            }
            self.acc |= u64::from(byte.unwrap_or(0)) << (56 - self.count);
            self.count += 8;
        }
    }

    fn peek(&mut self, n: u32) -> u32 {
        if self.count < n {
            self.fill();
        }
        (self.acc >> (64 - n)) as u32
    }

    fn skip(&mut self, n: u32) {
        self.acc <<= n;
        self.count -= n;
    }

    fn bits(&mut self, n: u32) -> u32 {
        if n == 0 {
            return 0;
        }
        let v = self.peek(n);
        self.skip(n);
        v
    }

    /// `n` bits as a signed value (T.81, F.2.2.1 `EXTEND`).
    fn signed(&mut self, n: u32) -> i32 {
        if n == 0 {
            return 0;
        }
        let v = self.bits(n) as i32;
        if v < 1 << (n - 1) {
            v - (1 << n) + 1
        } else {
            v
        }
    }

    fn decode(&mut self, table: &Huffman) -> Option<u8> {
        let entry = table.fast[self.peek(FAST_BITS) as usize];
        if entry != 0 {
            self.skip(u32::from(entry >> 8));
            return Some(entry as u8);
        }
        for len in FAST_BITS + 1..=16 {
            let code = self.peek(len) as i32;
            if code <= table.maxcode[len as usize] {
                self.skip(len);
                let index = code + table.valoffset[len as usize];
                return table.symbols.get(usize::try_from(index).ok()?).copied();
            }
        }
        None
    }

    /// Whether the bits read so far went past the scan's data into the zero padding.
    fn overran(&self) -> bool {
        self.count < self.padding
    }
}

struct Component {
    id: u8,
    h: usize,
    v: usize,
    quant_index: usize,
    /// The quantisation table in natural order, latched at the component's first scan as
    /// `jdinput.c`'s `latch_quant_tables` does (a later DQT does not change it).
    quant: Option<[u16; 64]>,
    /// Blocks across and down, padded to whole MCUs.
    blocks_w: usize,
    blocks_h: usize,
    /// `downsampled_width` and `downsampled_height` (`jdinput.c`): the samples that are image.
    width: usize,
    height: usize,
    /// Coefficients, natural order, 64 a block, row-major over the blocks.
    coefs: Vec<i16>,
    dc_pred: i32,
    /// Per zigzag coefficient, the lowest bit position a progressive scan has sent (-1: none);
    /// `jdphuff.c`'s `coef_bits`.
    coef_bits: [i8; 64],
}

#[derive(Default)]
struct Decoder {
    width: usize,
    height: usize,
    progressive: bool,
    components: Vec<Component>,
    quant: [Option<[u16; 64]>; 4],
    dc_tables: [Option<Huffman>; 4],
    ac_tables: [Option<Huffman>; 4],
    restart_interval: usize,
    jfif: bool,
    adobe_transform: Option<u8>,
    eob_run: u32,
}

/// A scan's spectral selection and successive approximation (T.81, B.2.3): coefficients `ss..=se`
/// in zigzag order, bit `al`, refining bit `ah` when nonzero.
#[derive(Clone, Copy)]
struct Band {
    ss: usize,
    se: usize,
    ah: u8,
    al: u8,
}

/// One component's part in a scan.
struct ScanComponent {
    index: usize,
    dc: usize,
    ac: usize,
}

impl Decoder {
    /// Reads markers and scans up to EOI.
    fn read(&mut self, data: &[u8]) -> Option<()> {
        if data.get(..2)? != [0xFF, 0xD8] {
            return None;
        }
        let mut pos = 2;
        loop {
            // Markers may be preceded by fill bytes 0xFF.
            if *data.get(pos)? != 0xFF {
                return None;
            }
            while *data.get(pos)? == 0xFF {
                pos += 1;
            }
            let marker = data[pos];
            pos += 1;
            if marker == 0xD9 {
                return Some(());
            }
            let len = usize::from(u16::from_be_bytes([*data.get(pos)?, *data.get(pos + 1)?]));
            let body = data.get(pos + 2..pos + len.checked_sub(2)? + 2)?;
            pos += len;
            match marker {
                0xC0..=0xC2 => self.frame(body, marker == 0xC2)?,
                0xC4 => self.huffman_tables(body)?,
                0xDB => self.quant_tables(body)?,
                0xDD => {
                    self.restart_interval = usize::from(u16::from_be_bytes(body.try_into().ok()?))
                }
                0xDA => pos = self.scan(body, data, pos)?,
                0xE0 => self.jfif |= body.starts_with(b"JFIF\0"),
                0xEE if body.starts_with(b"Adobe") && body.len() >= 12 => {
                    self.adobe_transform = Some(body[11]);
                }
                // Other APPn and COM carry no pixels.
                0xE0..=0xEF | 0xFE => {}
                // Other frame types (lossless, arithmetic), DAC, DNL, a stray RSTn or SOI.
                _ => return None,
            }
        }
    }

    fn frame(&mut self, body: &[u8], progressive: bool) -> Option<()> {
        if !self.components.is_empty() || body.len() < 6 || body[0] != 8 {
            return None;
        }
        self.progressive = progressive;
        self.height = usize::from(u16::from_be_bytes([body[1], body[2]]));
        self.width = usize::from(u16::from_be_bytes([body[3], body[4]]));
        let n = usize::from(body[5]);
        let pixels = (self.width * self.height) as u64;
        if !(n == 1 || n == 3) || body.len() != 6 + 3 * n || pixels == 0 || pixels > MAX_PIXELS {
            return None;
        }
        for c in body[6..].chunks_exact(3) {
            let (h, v) = (usize::from(c[1] >> 4), usize::from(c[1] & 15));
            if !(1..=4).contains(&h) || !(1..=4).contains(&v) || c[2] > 3 {
                return None;
            }
            self.components.push(Component {
                id: c[0],
                h,
                v,
                quant_index: usize::from(c[2]),
                quant: None,
                blocks_w: 0,
                blocks_h: 0,
                width: 0,
                height: 0,
                coefs: Vec::new(),
                dc_pred: 0,
                coef_bits: [-1; 64],
            });
        }
        let hmax = self.components.iter().map(|c| c.h).max()?;
        let vmax = self.components.iter().map(|c| c.v).max()?;
        let (mcus_x, mcus_y) = (
            self.width.div_ceil(8 * hmax),
            self.height.div_ceil(8 * vmax),
        );
        for c in &mut self.components {
            c.blocks_w = mcus_x * c.h;
            c.blocks_h = mcus_y * c.v;
            c.width = (self.width * c.h).div_ceil(hmax);
            c.height = (self.height * c.v).div_ceil(vmax);
            c.coefs = vec![0; c.blocks_w * c.blocks_h * 64];
        }
        Some(())
    }

    fn huffman_tables(&mut self, mut body: &[u8]) -> Option<()> {
        while !body.is_empty() {
            let (class, index) = (body[0] >> 4, usize::from(body[0] & 15));
            let counts: &[u8; 16] = body.get(1..17)?.try_into().ok()?;
            let total: usize = counts.iter().map(|&c| usize::from(c)).sum();
            let table = Huffman::new(counts, body.get(17..17 + total)?)?;
            match (class, index) {
                (0, 0..=3) => self.dc_tables[index] = Some(table),
                (1, 0..=3) => self.ac_tables[index] = Some(table),
                _ => return None,
            }
            body = &body[17 + total..];
        }
        Some(())
    }

    fn quant_tables(&mut self, mut body: &[u8]) -> Option<()> {
        while !body.is_empty() {
            let (precision, index) = (body[0] >> 4, usize::from(body[0] & 15));
            let size = if precision == 0 { 64 } else { 128 };
            let values = body.get(1..1 + size)?;
            let mut table = [0u16; 64];
            for (k, &natural) in ZIGZAG.iter().enumerate() {
                table[natural] = if precision == 0 {
                    u16::from(values[k])
                } else {
                    u16::from_be_bytes([values[2 * k], values[2 * k + 1]])
                };
            }
            *self.quant.get_mut(index)? = Some(table);
            body = &body[1 + size..];
        }
        Some(())
    }

    /// Decodes the scan whose header is `body` and whose data starts at `data[pos]`; returns the
    /// position of the marker after it.
    fn scan(&mut self, body: &[u8], data: &[u8], pos: usize) -> Option<usize> {
        let n = usize::from(*body.first()?);
        if self.components.is_empty() || n == 0 || body.len() != 4 + 2 * n {
            return None;
        }
        let mut scan = Vec::with_capacity(n);
        for c in body[1..1 + 2 * n].chunks_exact(2) {
            let index = self.components.iter().position(|comp| comp.id == c[0])?;
            let (dc, ac) = (usize::from(c[1] >> 4), usize::from(c[1] & 15));
            if dc > 3 || ac > 3 {
                return None;
            }
            scan.push(ScanComponent { index, dc, ac });
        }
        let (ss, se) = (usize::from(body[1 + 2 * n]), usize::from(body[2 + 2 * n]));
        let (ah, al) = (body[3 + 2 * n] >> 4, body[3 + 2 * n] & 15);
        if self.progressive {
            // jdphuff.c's start_pass_phuff_decoder checks.
            let dc = ss == 0;
            if (dc && se != 0) || (!dc && (n != 1 || se < ss || se > 63)) || al > 13 {
                return None;
            }
            if ah != 0 && al + 1 != ah {
                return None;
            }
            for s in &scan {
                let bits = &mut self.components[s.index].coef_bits;
                // A refinement needs the earlier scan of those coefficients.
                if ah != 0 && bits[ss..=se].iter().any(|&b| b < 0) {
                    return None;
                }
                bits[ss..=se].fill(al as i8);
            }
        } else if ss != 0 || se != 63 || ah != 0 || al != 0 {
            return None;
        }
        for s in &scan {
            let comp = &mut self.components[s.index];
            if comp.quant.is_none() {
                comp.quant = Some(self.quant[comp.quant_index]?);
            }
            comp.dc_pred = 0;
            let needs_dc = ss == 0 && ah == 0;
            let needs_ac = se > 0;
            if (needs_dc && self.dc_tables[s.dc].is_none())
                || (needs_ac && self.ac_tables[s.ac].is_none())
            {
                return None;
            }
        }
        self.eob_run = 0;
        let band = Band { ss, se, ah, al };

        // The MCUs: one block each in a one-component scan, over the component's own blocks
        // (T.81, A.2.2); h x v blocks of each component otherwise, over the padded grid.
        let (mcus_x, mcus_y) = if n == 1 {
            let c = &self.components[scan[0].index];
            (c.width.div_ceil(8), c.height.div_ceil(8))
        } else {
            let first = &self.components[scan[0].index];
            (first.blocks_w / first.h, first.blocks_h / first.v)
        };
        let mut bits = Bits::new(data, pos);
        let mut next_restart = 0u8;
        let total = mcus_x * mcus_y;
        for mcu in 0..total {
            if self.restart_interval > 0 && mcu > 0 && mcu % self.restart_interval == 0 {
                bits = self.restart(bits, &mut next_restart, &scan)?;
            }
            let (mx, my) = (mcu % mcus_x, mcu / mcus_x);
            for s in &scan {
                let (h, v) = if n == 1 {
                    (1, 1)
                } else {
                    let c = &self.components[s.index];
                    (c.h, c.v)
                };
                for by in 0..v {
                    for bx in 0..h {
                        let comp = &self.components[s.index];
                        let block = (my * v + by) * comp.blocks_w + mx * h + bx;
                        self.block(&mut bits, s, block, band)?;
                    }
                }
            }
            if bits.overran() {
                return None;
            }
        }
        // The next marker: past any bits left unread (T.81, B.1.1.5 pads with 1-bits).
        let mut end = bits.pos;
        while data.get(end)? != &0xFF || matches!(data.get(end + 1)?, 0x00 | 0xD0..=0xD7) {
            end += 1;
        }
        Some(end)
    }

    /// Consumes the RSTn marker ending a restart interval and resets the predictions (T.81,
    /// F.2.2.5 / G.1.2.3).
    fn restart<'a>(
        &mut self,
        bits: Bits<'a>,
        next: &mut u8,
        scan: &[ScanComponent],
    ) -> Option<Bits<'a>> {
        if bits.overran() {
            return None;
        }
        let mut pos = bits.pos;
        while bits.data.get(pos)? == &0xFF && bits.data.get(pos + 1)? == &0xFF {
            pos += 1;
        }
        if bits.data.get(pos..pos + 2)? != [0xFF, 0xD0 + *next] {
            return None;
        }
        *next = (*next + 1) % 8;
        for s in scan {
            self.components[s.index].dc_pred = 0;
        }
        self.eob_run = 0;
        Some(Bits::new(bits.data, pos + 2))
    }

    /// Decodes one block's share of the scan into `block` of component `s`.
    fn block(
        &mut self,
        bits: &mut Bits,
        s: &ScanComponent,
        block: usize,
        band: Band,
    ) -> Option<()> {
        let Band { ss, se, ah, al } = band;
        let comp = &mut self.components[s.index];
        let coefs: &mut [i16; 64] = comp
            .coefs
            .get_mut(block * 64..block * 64 + 64)?
            .try_into()
            .ok()?;
        if !self.progressive {
            // jdhuff.c's decode_mcu: DC difference, then run-length AC.
            let size = bits.decode(self.dc_tables[s.dc].as_ref()?)?;
            if size > 16 {
                return None;
            }
            comp.dc_pred = comp.dc_pred.wrapping_add(bits.signed(u32::from(size)));
            coefs[0] = comp.dc_pred as i16;
            let table = self.ac_tables[s.ac].as_ref()?;
            let mut k = 1;
            while k < 64 {
                let rs = bits.decode(table)?;
                let (run, size) = (usize::from(rs >> 4), u32::from(rs & 15));
                if size == 0 {
                    if run != 15 {
                        break;
                    }
                    k += 16;
                    continue;
                }
                k += run;
                *coefs.get_mut(*ZIGZAG.get(k)?)? = bits.signed(size) as i16;
                k += 1;
            }
            return Some(());
        }
        // jdphuff.c's four progressive decoders.
        if ss == 0 {
            if ah == 0 {
                let size = bits.decode(self.dc_tables[s.dc].as_ref()?)?;
                if size > 16 {
                    return None;
                }
                comp.dc_pred = comp.dc_pred.wrapping_add(bits.signed(u32::from(size)));
                coefs[0] = (comp.dc_pred << al) as i16;
            } else if bits.bits(1) == 1 {
                coefs[0] |= 1 << al;
            }
            return Some(());
        }
        let table = self.ac_tables[s.ac].as_ref()?;
        if ah == 0 {
            // decode_mcu_AC_first.
            if self.eob_run > 0 {
                self.eob_run -= 1;
                return Some(());
            }
            let mut k = ss;
            while k <= se {
                let rs = bits.decode(table)?;
                let (run, size) = (usize::from(rs >> 4), u32::from(rs & 15));
                if size == 0 {
                    if run != 15 {
                        self.eob_run = (1 << run) + bits.bits(run as u32) - 1;
                        break;
                    }
                    k += 16;
                    continue;
                }
                k += run;
                if k > se {
                    return None;
                }
                coefs[ZIGZAG[k]] = (bits.signed(size) << al) as i16;
                k += 1;
            }
            return Some(());
        }
        // decode_mcu_AC_refine: one correction bit per nonzero coefficient passed, zero runs
        // counting only the coefficients still zero.
        let (p1, m1) = (1i16 << al, (-1i16) << al);
        let mut k = ss;
        if self.eob_run == 0 {
            while k <= se {
                let rs = bits.decode(table)?;
                let (mut run, size) = (i32::from(rs >> 4), rs & 15);
                let mut value = 0;
                if size != 0 {
                    if size != 1 {
                        return None;
                    }
                    value = if bits.bits(1) == 1 { p1 } else { m1 };
                } else if run != 15 {
                    self.eob_run = (1 << run) + bits.bits(run as u32);
                    break;
                }
                while k <= se {
                    let coef = &mut coefs[ZIGZAG[k]];
                    if *coef != 0 {
                        refine(bits, coef, p1, m1);
                    } else {
                        run -= 1;
                        if run < 0 {
                            break;
                        }
                    }
                    k += 1;
                }
                if value != 0 {
                    *coefs.get_mut(*ZIGZAG.get(k)?)? = value;
                }
                k += 1;
            }
        }
        if self.eob_run > 0 {
            for &natural in ZIGZAG.get(k..=se)? {
                let coef = &mut coefs[natural];
                if *coef != 0 {
                    refine(bits, coef, p1, m1);
                }
            }
            self.eob_run -= 1;
        }
        Some(())
    }

    /// The pixels, once every scan is read.
    fn finish(mut self) -> Option<DynamicImage> {
        let hmax = self.components.iter().map(|c| c.h).max()?;
        let vmax = self.components.iter().map(|c| c.v).max()?;
        // jdcoefct.c smooths blocks (do_block_smoothing, smoothing_ok) when a progressive file
        // leaves any of the first ten coefficients unrefined; that is not reproduced here.
        if self.progressive
            && (self.components.iter()).any(|c| c.coef_bits[..10].iter().any(|&b| b != 0))
        {
            return None;
        }
        let mut planes = Vec::with_capacity(self.components.len());
        for comp in &mut self.components {
            let samples = comp.samples()?;
            // The coefficients are done with: free them before the next plane.
            comp.coefs = Vec::new();
            planes.push(upsample(
                &samples,
                comp,
                hmax,
                vmax,
                self.width,
                self.height,
            )?);
        }
        let (w, h) = (
            u32::try_from(self.width).ok()?,
            u32::try_from(self.height).ok()?,
        );
        if let [grey] = &planes[..] {
            return GrayImage::from_raw(w, h, grey.clone()).map(DynamicImage::ImageLuma8);
        }
        let ids: Vec<u8> = self.components.iter().map(|c| c.id).collect();
        // jdapimin.c's default_decompress_parms: the colour space of a 3-component file.
        let rgb = match (self.jfif, self.adobe_transform) {
            (true, _) => false,
            (false, Some(transform)) => transform == 0,
            (false, None) => ids == [b'R', b'G', b'B'],
        };
        let mut out = Vec::with_capacity(self.width * self.height * 3);
        for ((&y, &cb), &cr) in planes[0].iter().zip(&planes[1]).zip(&planes[2]) {
            if rgb {
                out.extend([y, cb, cr]);
            } else {
                out.extend(ycc_to_rgb(y, cb, cr));
            }
        }
        RgbImage::from_raw(w, h, out).map(DynamicImage::ImageRgb8)
    }
}

/// One correction bit of a nonzero coefficient (`jdphuff.c`): adds the bit's weight, away from 0,
/// unless that bit is already set.
fn refine(bits: &mut Bits, coef: &mut i16, p1: i16, m1: i16) {
    if bits.bits(1) == 1 && *coef & p1 == 0 {
        *coef = coef.wrapping_add(if *coef >= 0 { p1 } else { m1 });
    }
}

impl Component {
    /// The component's samples after the IDCT: `blocks_w * 8` wide, `blocks_h * 8` high.
    fn samples(&self) -> Option<Vec<u8>> {
        let quant = self.quant?;
        let stride = self.blocks_w * 8;
        let mut out = vec![0u8; stride * self.blocks_h * 8];
        for (i, block) in self.coefs.chunks_exact(64).enumerate() {
            let (bx, by) = (i % self.blocks_w, i / self.blocks_w);
            idct_islow(
                block.try_into().ok()?,
                &quant,
                &mut out[by * 8 * stride + bx * 8..],
                stride,
            );
        }
        Some(out)
    }
}

/// `jidctint.c`'s `jpeg_idct_islow`: the LL&M 8x8 IDCT in 13-bit fixed point, 2 extra bits kept
/// between the column and the row pass. The result is clamped to 0..=255 after the +128 level
/// shift as libjpeg-turbo's SIMD versions do (the C version's range-limit table wraps instead,
/// which differs only beyond the range a valid image reaches).
fn idct_islow(coefs: &[i16; 64], quant: &[u16; 64], out: &mut [u8], stride: usize) {
    const CONST_BITS: u32 = 13;
    const PASS1_BITS: u32 = 2;
    // FIX(x) = round(x * 2^13), the constants of jidctint.c.
    const FIX_0_298631336: i64 = 2446;
    const FIX_0_390180644: i64 = 3196;
    const FIX_0_541196100: i64 = 4433;
    const FIX_0_765366865: i64 = 6270;
    const FIX_0_899976223: i64 = 7373;
    const FIX_1_175875602: i64 = 9633;
    const FIX_1_501321110: i64 = 12299;
    const FIX_1_847759065: i64 = 15137;
    const FIX_1_961570560: i64 = 16069;
    const FIX_2_053119869: i64 = 16819;
    const FIX_2_562915447: i64 = 20995;
    const FIX_3_072711026: i64 = 25172;
    fn descale(x: i64, n: u32) -> i64 {
        (x + (1 << (n - 1))) >> n
    }
    /// The butterfly shared by both passes: eight inputs to eight outputs before descaling.
    fn butterfly(v: [i64; 8]) -> [i64; 8] {
        let (z2, z3) = (v[2], v[6]);
        let z1 = (z2 + z3) * FIX_0_541196100;
        let tmp2 = z1 - z3 * FIX_1_847759065;
        let tmp3 = z1 + z2 * FIX_0_765366865;
        let tmp0 = (v[0] + v[4]) << CONST_BITS;
        let tmp1 = (v[0] - v[4]) << CONST_BITS;
        let (tmp10, tmp13) = (tmp0 + tmp3, tmp0 - tmp3);
        let (tmp11, tmp12) = (tmp1 + tmp2, tmp1 - tmp2);

        let (t0, t1, t2, t3) = (v[7], v[5], v[3], v[1]);
        let (z1, z2, z3, z4) = (t0 + t3, t1 + t2, t0 + t2, t1 + t3);
        let z5 = (z3 + z4) * FIX_1_175875602;
        let (t0, t1) = (t0 * FIX_0_298631336, t1 * FIX_2_053119869);
        let (t2, t3) = (t2 * FIX_3_072711026, t3 * FIX_1_501321110);
        let (z1, z2) = (-z1 * FIX_0_899976223, -z2 * FIX_2_562915447);
        let z3 = -z3 * FIX_1_961570560 + z5;
        let z4 = -z4 * FIX_0_390180644 + z5;
        let (t0, t1) = (t0 + z1 + z3, t1 + z2 + z4);
        let (t2, t3) = (t2 + z2 + z3, t3 + z1 + z4);
        [
            tmp10 + t3,
            tmp11 + t2,
            tmp12 + t1,
            tmp13 + t0,
            tmp13 - t0,
            tmp12 - t1,
            tmp11 - t2,
            tmp10 - t3,
        ]
    }
    let mut ws = [0i64; 64];
    for col in 0..8 {
        let v: [i64; 8] = std::array::from_fn(|row| {
            i64::from(coefs[row * 8 + col]) * i64::from(quant[row * 8 + col])
        });
        // The shortcut for columns with no AC terms gives the same values as the full pass.
        let r = butterfly(v);
        for row in 0..8 {
            ws[row * 8 + col] = descale(r[row], CONST_BITS - PASS1_BITS);
        }
    }
    for row in 0..8 {
        let v: [i64; 8] = ws[row * 8..row * 8 + 8].try_into().unwrap();
        let r = butterfly(v);
        for (col, &x) in r.iter().enumerate() {
            let x = descale(x, CONST_BITS + PASS1_BITS + 3) + 128;
            out[row * stride + col] = x.clamp(0, 255) as u8;
        }
    }
}

/// A component's samples upsampled to the image's size, as `jdsample.c`'s `jinit_upsampler`
/// picks: "fancy" triangle filters for 2:1 horizontal (`h2v1_fancy_upsample`), 2:1 vertical
/// (`h1v2_fancy_upsample`) and both (`h2v2_fancy_upsample`), box replication otherwise
/// (`int_upsample`; also the 2:1 horizontal cases when the component is 2 samples wide or less).
/// Only the `width` x `height` samples that are image count; above the first row and below the
/// last the edge row repeats (`jdmainct.c`'s context rows, `set_bottom_pointers`).
fn upsample(
    samples: &[u8],
    comp: &Component,
    hmax: usize,
    vmax: usize,
    width: usize,
    height: usize,
) -> Option<Vec<u8>> {
    let stride = comp.blocks_w * 8;
    let (w, h) = (comp.width, comp.height);
    let row = |y: usize| &samples[y * stride..y * stride + w];
    let mut out = Vec::with_capacity(width * height);
    let (fx, fy) = (hmax / comp.h, vmax / comp.v);
    if !hmax.is_multiple_of(comp.h) || !vmax.is_multiple_of(comp.v) {
        // jdsample.c: JERR_FRACT_SAMPLE_NOTIMPL.
        return None;
    }
    let fancy_h = fx == 2 && w > 2;
    match (fx, fy) {
        (1, 1) => (0..height).for_each(|y| out.extend(&row(y)[..width])),
        (2, 1) if fancy_h => {
            for y in 0..height {
                let mut line = Vec::with_capacity(2 * w);
                h2v1_fancy(row(y), &mut line);
                out.extend(&line[..width]);
            }
        }
        (1, 2) => {
            for y in 0..height {
                let (near, far, bias) = vertical_neighbours(y, h);
                out.extend(
                    (row(near).iter().zip(row(far)))
                        .map(|(&a, &b)| ((3 * u16::from(a) + u16::from(b) + bias) >> 2) as u8)
                        .take(width),
                );
            }
        }
        (2, 2) if fancy_h => {
            for y in 0..height {
                let (near, far, _) = vertical_neighbours(y, h);
                let sums: Vec<i32> = (row(near).iter().zip(row(far)))
                    .map(|(&a, &b)| 3 * i32::from(a) + i32::from(b))
                    .collect();
                let mut line = Vec::with_capacity(2 * w);
                h2v2_fancy(&sums, &mut line);
                out.extend(&line[..width]);
            }
        }
        _ => {
            for y in 0..height {
                let src = row(y / fy);
                out.extend((0..width).map(|x| src[x / fx]));
            }
        }
    }
    Some(out)
}

/// For output row `y` of a 2:1 vertical upsampling of `h` rows: the nearer input row, the farther
/// one (the edge row repeated at the top and bottom) and `h1v2_fancy_upsample`'s rounding bias
/// (1 when the farther row is above, 2 below: an ordered dither).
fn vertical_neighbours(y: usize, h: usize) -> (usize, usize, u16) {
    let near = y / 2;
    if y.is_multiple_of(2) {
        (near, near.saturating_sub(1), 1)
    } else {
        (near, (near + 1).min(h - 1), 2)
    }
}

/// `h2v1_fancy_upsample` on one row of at least 3 samples: 3/4 of the nearer sample and 1/4 of
/// the farther, rounding biases 1 and 2 alternating; the edge samples are copied.
fn h2v1_fancy(input: &[u8], out: &mut Vec<u8>) {
    let n = input.len();
    let s = |i: usize| u16::from(input[i]);
    out.push(input[0]);
    out.push(((3 * s(0) + s(1) + 2) >> 2) as u8);
    for i in 1..n - 1 {
        out.push(((3 * s(i) + s(i - 1) + 1) >> 2) as u8);
        out.push(((3 * s(i) + s(i + 1) + 2) >> 2) as u8);
    }
    out.push(((3 * s(n - 1) + s(n - 2) + 1) >> 2) as u8);
    out.push(input[n - 1]);
}

/// `h2v2_fancy_upsample` on one row of column sums `3 * nearer row + farther row`: the
/// horizontal triangle filter on the sums, one rounding at the end (biases 8 and 7).
fn h2v2_fancy(sums: &[i32], out: &mut Vec<u8>) {
    let n = sums.len();
    out.push(((sums[0] * 4 + 8) >> 4) as u8);
    out.push(((sums[0] * 3 + sums[1] + 7) >> 4) as u8);
    for i in 1..n - 1 {
        out.push(((sums[i] * 3 + sums[i - 1] + 8) >> 4) as u8);
        out.push(((sums[i] * 3 + sums[i + 1] + 7) >> 4) as u8);
    }
    out.push(((sums[n - 1] * 3 + sums[n - 2] + 8) >> 4) as u8);
    out.push(((sums[n - 1] * 4 + 7) >> 4) as u8);
}

/// `jdcolor.c`'s `ycc_rgb_convert`: 16-bit fixed point, R and B rounded per table entry, G's two
/// terms summed before one rounding, then clamped.
fn ycc_to_rgb(y: u8, cb: u8, cr: u8) -> [u8; 3] {
    // FIX(x) = round(x * 2^16) (build_ycc_rgb_table).
    const FIX_1_40200: i32 = 91881;
    const FIX_1_77200: i32 = 116130;
    const FIX_0_71414: i32 = 46802;
    const FIX_0_34414: i32 = 22554;
    const ONE_HALF: i32 = 1 << 15;
    let (y, cb, cr) = (i32::from(y), i32::from(cb) - 128, i32::from(cr) - 128);
    let r = y + ((FIX_1_40200 * cr + ONE_HALF) >> 16);
    let g = y + ((-FIX_0_34414 * cb + ONE_HALF - FIX_0_71414 * cr) >> 16);
    let b = y + ((FIX_1_77200 * cb + ONE_HALF) >> 16);
    [r, g, b].map(|v| v.clamp(0, 255) as u8)
}
