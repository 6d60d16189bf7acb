//! Products split over rayon's threads where in-process trainers take over the BLAS's own
//! threading (`blas_lib::split_products`): the same values, to the bit, as the library's.
//! A test binary of its own: the takeover changes the process's BLAS thread count.

use burn::tensor::{Distribution, Tensor};
use pipewright_runtime::kernels::matmul;
use pipewright_runtime::machine::blas_lib;

#[test]
fn split_products_equal_the_librarys_to_the_bit() {
    if let Some(passed) =
        blas_lib::rerun_on_chosen_kernels("split_products_equal_the_librarys_to_the_bit")
    {
        assert!(
            passed,
            "on the kernels pipewright chooses for this CPU (the run above)"
        );
        return;
    }
    let dev = pipewright_runtime::backend::plain_device();
    // 600 x 300 x 500 multiply-adds (over the split threshold), rows not a multiple of 2 x 16,
    // and a batch of two.
    let a = Tensor::<3>::random([2, 601, 300], Distribution::Default, &dev);
    let b = Tensor::<3>::random([2, 300, 500], Distribution::Default, &dev);
    let threads = blas_lib::blas_threads();
    let library = matmul(a.clone(), b.clone()).into_data();
    // The system library throughout (no move to MKL on an Intel CPU: tests/split_mkl.rs).
    let n = blas_lib::split_products_with(|| None);
    assert_eq!(blas_lib::split_products_with(|| None), n, "decided once");
    assert_eq!(blas_lib::split_threads(), n);
    let pool = rayon::current_num_threads();
    match n {
        0 => {
            assert_eq!(blas_lib::blas_threads(), threads, "left to the library");
            let lib = threads.unwrap_or(1).max(1) as usize;
            assert!(
                lib.min(pool) < 2 || lib.min(pool) > 4,
                "{lib} BLAS, {pool} rayon threads"
            );
        }
        _ => {
            assert!((2..=4).contains(&n));
            assert_eq!(
                blas_lib::blas_threads(),
                Some(1),
                "the library single-threaded"
            );
        }
    }
    eprintln!("products split over {n} threads ({pool} rayon threads)");
    let split = matmul(a, b).into_data();
    assert_eq!(split, library);
}
