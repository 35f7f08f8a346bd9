//! What cohort-gguf's integration tests share: a minimal GGUF writer for hand-made (and
//! deliberately broken) files, and the Python packages the reference checks need.

#![allow(dead_code)]

pub mod python;

/// Builds a GGUF v3 file in memory: metadata entries and tensors in the order added.
pub struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
    alignment: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Default for Writer {
    fn default() -> Self {
        Writer {
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            data: Vec::new(),
            alignment: 32,
        }
    }
}

impl Writer {
    /// A metadata entry of value type `ty` whose encoded value is `value`.
    pub fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }

    pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv_raw(key, 6, &v.to_le_bytes())
    }

    pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.kv_raw(key, 7, &[v as u8])
    }

    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        string(&mut b, v);
        self.kv_raw(key, 8, &b)
    }

    pub fn kv_strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let mut b = 8u32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        for s in v {
            string(&mut b, s);
        }
        self.kv_raw(key, 9, &b)
    }

    pub fn kv_i32s(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let mut b = 5u32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        for x in v {
            b.extend(x.to_le_bytes());
        }
        self.kv_raw(key, 9, &b)
    }

    /// Sets `general.alignment` (and uses it for the data that follows).
    pub fn alignment(&mut self, a: u32) -> &mut Self {
        self.alignment = a as u64;
        self.kv_u32("general.alignment", a)
    }

    /// A tensor of ggml type `ty` with ggml dims `dims` (fastest first) and raw `bytes`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        let pad = (self.data.len() as u64).next_multiple_of(self.alignment) as usize;
        self.data.resize(pad, 0);
        string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(bytes);
        self.n_tensors += 1;
        self
    }

    /// An f32 tensor.
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, 0, &bytes)
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        let data_start = (out.len() as u64).next_multiple_of(self.alignment) as usize;
        out.resize(data_start, 0);
        out.extend(&self.data);
        out
    }
}
