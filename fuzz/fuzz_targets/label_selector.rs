//! The `external-filter` header's label selector: any text a client sends must parse or be
//! refused, never panic (a panic aborts the worker's VM), and a parsed selector must judge any
//! pod's labels. A selector that parses keeps parsing the same after its text is trimmed.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::label_selector::Selector;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(selector) = Selector::parse(&text) else {
        return;
    };
    assert_eq!(Selector::parse(text.trim()).ok().as_ref(), Some(&selector));
    // Labels made from the text itself, so keys the selector names are sometimes present.
    let words: Vec<String> = text
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect();
    let labels: Vec<(String, String)> = words
        .chunks(2)
        .map(|pair| (pair[0].clone(), pair.get(1).cloned().unwrap_or_default()))
        .collect();
    let _ = selector.matches(&labels);
    let _ = selector.matches(&[]);
});
