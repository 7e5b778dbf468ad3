//! CLI names of the library's user choices ([`clap::ValueEnum`]s such as
//! [`crate::attention::AttentionName`] and [`crate::eval::CacheKind`]), for messages and docs.

use clap::ValueEnum;

/// The CLI names of a value enum's variants, comma-separated.
pub fn value_names<T: ValueEnum>() -> String {
    T::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|v| v.get_name().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
