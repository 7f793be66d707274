//! Which filter a gateway runs. The name comes from what the module is made of, at build
//! time (`build.rs`: the crate version and a hash of `src/`, `proto/`, the build script, the
//! crate's and the workspace's manifests, `Cargo.lock`, and the features and profile), so two
//! builds of one tree agree, a dependency update is a new build, and no git is needed. Each VM logs it when it
//! starts, and every snapshot poll carries it: pd-control counts the gateways on each build
//! (`pd_control_gateway_builds`), where a filter update that reached only some gateways shows.

/// This filter's build name, `<version>+<12 hex digits>`.
pub const BUILD: &str = env!("PD_ROUTER_BUILD");

/// Snapshot-poll request header naming the caller's [`BUILD`].
pub const BUILD_HEADER: &str = "x-pd-build";

/// A poll header's build name when it could be one (at most 64 characters of letters, digits
/// and `.+-_`); pd-control exports it as a label, so a caller's text is bounded.
pub fn label_of(text: &str) -> Option<&str> {
    let fits = !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-' | b'_'));
    fits.then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_is_a_valid_label_and_foreign_text_is_not() {
        assert_eq!(label_of(BUILD), Some(BUILD));
        assert!(BUILD.starts_with(concat!(env!("CARGO_PKG_VERSION"), "+")));
        assert_eq!(BUILD.len(), env!("CARGO_PKG_VERSION").len() + 13);
        for bad in ["", "a\"b", "a b", "x{}", &"a".repeat(65)] {
            assert_eq!(label_of(bad), None, "{bad:?}");
        }
    }
}
