//! Links the system OpenBLAS (Debian: libopenblas-dev; scripts/install-deps installs it), whose
//! `cblas_sgemm` runs the model's matmuls (see src/kernels.rs).
fn main() {
    println!("cargo:rustc-link-lib=openblas");
}
