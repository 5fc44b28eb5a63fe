//! `--device cuda` with CUDA libraries that load but lack the entry points cudarc needs (a stub,
//! another program's library under the driver's name): one clear line, exit 2, before cudarc is
//! touched, in every command that opens the GPU. cudarc itself would panic ("Missing symbol").

use std::path::Path;
use std::process::Command;

use sinkmerge::forward::backend::cuda::driver::LIBRARY_SYMBOLS;

use crate::util::{fixture, sinkmerge};

/// A directory of shared libraries under the names cudarc tries first for libcuda, libnvrtc and
/// libcublas (`cudarc::get_lib_name_candidates`), each built from the C `source`. Built with the C
/// compiler `build.rs` already needs (`$CC`, else `cc`).
fn stub_libraries(dir: &Path, source: &str) {
    let c = dir.join("stub.c");
    std::fs::write(&c, source).unwrap();
    let stub = dir.join("stub.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&stub)
        .arg(&c)
        .status()
        .unwrap_or_else(|e| panic!("the C compiler `{cc}` (as build.rs uses) cannot run: {e}"));
    assert!(status.success(), "`{cc}` could not build the stub library");
    for name in ["libcuda.so", "libcuda.so.1", "libnvrtc.so", "libcublas.so"] {
        std::fs::copy(&stub, dir.join(name)).unwrap();
    }
}

#[test]
fn a_cuda_library_without_its_symbols_is_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    stub_libraries(tmp.path(), "int sinkmerge_stub(void) { return 0; }\n");
    every_gpu_command_refused(
        tmp.path(),
        &["--device cuda", "libcuda.so", "`cuInit`", "--device cpu"],
    );
}

/// `score`, `heads` and `parity` on the GPU, with the libraries of `libraries`: each refused
/// in one line naming `needles`.
fn every_gpu_command_refused(libraries: &Path, needles: &[&str]) {
    let model = fixture("qwen2");
    let model = model.to_str().unwrap();
    let runs: [&[&str]; 3] = [
        &["score", model, "--device", "cuda"],
        &["heads", model, model, "--device", "cuda"],
        &["parity", model],
    ];
    for args in runs {
        sinkmerge(args)
            .env("LD_LIBRARY_PATH", libraries)
            .refused(needles);
    }
}

/// A driver with every entry point whose `cuInit` fails and whose `cuGetErrorString` (and
/// `cuGetErrorName`) answers success with a NULL string: the error is reported with its numeric
/// code, where reading the string would crash (cudarc's own Display reads it unchecked).
#[test]
fn a_driver_without_error_strings_gets_the_numeric_code() {
    let tmp = tempfile::tempdir().unwrap();
    let mut source = String::from(
        "#include <stddef.h>\n\
         int cuInit(unsigned flags) { return 100; } /* CUDA_ERROR_NO_DEVICE */\n\
         int cuGetErrorString(int e, const char **s) { *s = NULL; return 0; }\n\
         int cuGetErrorName(int e, const char **s) { *s = NULL; return 0; }\n",
    );
    for (_, _, symbols) in LIBRARY_SYMBOLS {
        for symbol in symbols {
            if !["cuInit", "cuGetErrorString", "cuGetErrorName"].contains(symbol) {
                source += &format!("int {symbol}(void) {{ return 1; }}\n");
            }
        }
    }
    stub_libraries(tmp.path(), &source);
    every_gpu_command_refused(
        tmp.path(),
        &["--device cuda", "finds no usable GPU", "CUDA error 100"],
    );
}
