//! The network helpers of `checks/net.rs`.

use crate::doctor;

#[test]
fn proxy_in_use_names_the_variable_and_hides_credentials() {
    use doctor::checks::net::proxy_in_use;
    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }
    let https = "https://relay.example.com:8443/base";
    assert_eq!(
        proxy_in_use(https, &env(&[("HTTPS_PROXY", "http://me:pw@proxy:3128")])),
        Some("http://***@proxy:3128 (HTTPS_PROXY)".into())
    );
    assert_eq!(
        proxy_in_use(
            "http://relay.example.com",
            &env(&[("HTTPS_PROXY", "http://proxy:3128")])
        ),
        None,
        "HTTPS_PROXY is for https URLs"
    );
    assert_eq!(
        proxy_in_use(
            "http://relay.example.com",
            &env(&[("http_proxy", "proxy:8080"), ("ALL_PROXY", "socks5://s:1")])
        ),
        Some("proxy:8080 (http_proxy)".into())
    );
    assert_eq!(
        proxy_in_use(https, &env(&[("ALL_PROXY", "socks5h://a:b@s:1")])),
        Some("socks5h://***@s:1 (ALL_PROXY)".into())
    );
    for no in [
        "localhost,.example.com",
        "example.com",
        "*",
        "relay.example.com",
    ] {
        let vars: &'static [(&str, &str)] = Box::leak(Box::new([
            ("HTTPS_PROXY", "http://p:1"),
            (
                "NO_PROXY",
                Box::leak(no.to_string().into_boxed_str()) as &str,
            ),
        ]));
        assert_eq!(proxy_in_use(https, &env(vars)), None, "{no}");
    }
    assert_eq!(
        proxy_in_use(
            https,
            &env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "ample.com")])
        ),
        Some("http://p:1 (HTTPS_PROXY)".into())
    );
    assert_eq!(proxy_in_use(https, &env(&[])), None);
}
