//! Structured mutations for the fuzz tests of every crate: the numbers in a real input file
//! replaced by edge values (0, -1, fractions, huge, overflowing, non-finite).

/// What a number in a file is replaced by.
pub const EDGES: [&str; 15] = [
    "0",
    "1",
    "-1",
    "3",
    "7",
    "2.5",
    "1e308",
    "-1e308",
    "nan",
    "inf",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "100000000",
];

/// Byte ranges of the unsigned numbers (digits and dots) in `text` that do not continue a word.
pub fn number_spans(text: &str) -> Vec<(usize, usize)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
            let s = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                i += 1;
            }
            if i == b.len() || !b[i].is_ascii_alphabetic() {
                out.push((s, i));
            }
        } else {
            i += 1;
        }
    }
    out
}

/// `text` with the numbers picked by `picks` ((number index, edge index), both taken modulo
/// their counts) replaced by edge values.
pub fn mutate(text: &str, picks: &[(usize, usize)]) -> String {
    let nums = number_spans(text);
    if nums.is_empty() {
        return text.to_string();
    }
    let mut chosen: Vec<(usize, usize, &str)> = picks
        .iter()
        .map(|&(i, e)| {
            let (s, t) = nums[i % nums.len()];
            (s, t, EDGES[e % EDGES.len()])
        })
        .collect();
    chosen.sort_by_key(|c| std::cmp::Reverse(c.0));
    chosen.dedup_by_key(|c| c.0);
    let mut out = text.to_string();
    for (s, t, v) in chosen {
        out.replace_range(s..t, v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_found_and_replaced() {
        assert_eq!(number_spans("a = 12, b2 = 3.5 x7"), vec![(4, 6), (13, 16)]);
        assert_eq!(mutate("x = 12", &[(0, 1)]), "x = 1");
    }
}
