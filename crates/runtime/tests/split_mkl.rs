//! In-process products moved to MKL (`blas_lib::split_products` on an Intel CPU where MKL is
//! installed): MKL, run sequentially, multiplies as OpenBLAS does (to rounding) and the run
//! header says it runs them. Where no MKL is installed, a library that cannot be loaded leaves
//! the products on OpenBLAS, and the header says why. A test binary of its own: the move is
//! process-wide.

use burn::tensor::{Distribution, Tensor};
use pipewright_runtime::kernels::matmul;
use pipewright_runtime::machine::blas_lib;

#[test]
fn products_move_to_mkl_or_stay_and_say_why() {
    let dev = pipewright_runtime::backend::plain_device();
    let a = Tensor::<3>::random([2, 601, 300], Distribution::Default, &dev);
    let b = Tensor::<3>::random([2, 300, 500], Distribution::Default, &dev);
    let before: Vec<f32> = matmul(a.clone(), b.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let system = blas_lib::blas()
        .expect("system OpenBLAS")
        .description
        .clone();
    let threads = blas_lib::blas_threads();
    let mkl = blas_lib::find_mkl();
    let asked = mkl
        .clone()
        .unwrap_or_else(|| "/nonexistent/libmkl_rt.so.2".into());
    let n = blas_lib::split_products_with(|| Some(asked.clone()));
    let now = blas_lib::blas().expect("a library").description.clone();
    let note = blas_lib::split_note();
    if n == 0 && threads != Some(1) {
        // Left to the library's threading (more threads than are split): nothing moves.
        assert_eq!(now, system);
        assert_eq!(note, None);
        return;
    }
    let note = note.expect("a header note");
    match &mkl {
        Some(p) => {
            assert!(now.contains(&p.display().to_string()), "{now}");
            assert!(now.contains("sequential"), "{now}");
            assert!(note.contains("MKL runs them"), "{note}");
            assert_eq!(blas_lib::blas_threads(), Some(1), "sequential");
        }
        None => {
            assert_eq!(now, system, "stays on the system library");
            assert!(note.contains("could not be used"), "{note}");
            assert!(note.contains("/nonexistent/libmkl_rt.so.2"), "{note}");
        }
    }
    eprintln!("{note}");
    let after: Vec<f32> = matmul(a, b).into_data().try_to_vec::<f32>().unwrap();
    let scale = before.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = before
        .iter()
        .zip(&after)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "{worst} against values up to {scale}"
    );
}
