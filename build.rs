//! Compiles the CUDA backend's kernels (`src/forward/backend/cuda/kernels.cu`) for the host through
//! `host_shim.h`, so the tests run the GPU scorer's code path on machines without a GPU. Only the
//! tests call into it; the linker leaves it out of the binary.

// Cargo reads a build script's instructions from its stdout (clippy.toml forbids printing in the
// crate, where commands report through their writer).
#![allow(clippy::disallowed_macros)]

fn main() {
    let dir = "src/forward/backend/cuda";
    for file in ["kernels.cu", "host_shim.h", "host_kernels.cpp"] {
        println!("cargo:rerun-if-changed={dir}/{file}");
    }
    cc::Build::new()
        .cpp(true)
        // No C++ runtime: the shim uses only templates, so the binary needs no libstdc++.
        .cpp_link_stdlib(None)
        .file(format!("{dir}/host_kernels.cpp"))
        .flag("-std=c++17")
        .flag("-fno-exceptions")
        .flag("-fno-rtti")
        // As NVRTC's --fmad=false and Rust: no multiply-add contraction.
        .flag("-ffp-contract=off")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .opt_level(2)
        .compile("sinkmerge_host_kernels");
}
