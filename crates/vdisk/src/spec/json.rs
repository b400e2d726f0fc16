//! QEMU's JSON (qobject/json-lexer.c, json-streamer.c, json-parser.c, qjson.c), as `json:`
//! file names are read: strings in double or single quotes, numbers kept as written, the
//! first error reported with QEMU's words. QEMU lexes first and parses a value only once its
//! braces balance, so a stray character anywhere in a value wins over a syntax error before it;
//! this parser does the same.

use std::fmt::Write;

/// A JSON value; numbers keep their text, dicts their members' order.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    List(Vec<Json>),
    Dict(Vec<(String, Json)>),
}

/// QEMU's limit on how deep values nest (json-streamer.c): deeper input is refused, not
/// recursed into.
const MAX_NESTING: usize = 1024;

#[derive(Debug, Clone, PartialEq)]
enum Token {
    LCurly,
    RCurly,
    LSquare,
    RSquare,
    Colon,
    Comma,
    Str(String),
    Num(String),
    Keyword(String),
}

/// Parses `text` as exactly one JSON value, or gives QEMU's message for why it is not one.
pub fn parse(text: &str) -> Result<Json, String> {
    let mut result: Option<Json> = None;
    let mut lexer = Lexer { text, at: 0 };
    let mut tokens = Vec::new();
    let (mut braces, mut brackets) = (0i64, 0i64);
    loop {
        let token = match lexer.next() {
            Ok(Some(t)) => t,
            Ok(None) if tokens.is_empty() => break,
            Ok(None) => {
                emit(&mut result, parse_message(&tokens))?;
                break;
            }
            Err(stray) => {
                return Err(at_most_one(
                    &result,
                    format!("JSON parse error, stray '{stray}'"),
                ))
            }
        };
        match token {
            Token::LCurly => braces += 1,
            Token::RCurly => braces -= 1,
            Token::LSquare => brackets += 1,
            Token::RSquare => brackets -= 1,
            _ => {}
        }
        if braces + brackets > MAX_NESTING as i64 {
            let e = "JSON nesting depth limit exceeded".to_string();
            return Err(at_most_one(&result, e));
        }
        tokens.push(token);
        if (braces > 0 || brackets > 0) && braces >= 0 && brackets >= 0 {
            continue;
        }
        emit(&mut result, parse_message(&tokens))?;
        tokens.clear();
        (braces, brackets) = (0, 0);
    }
    result.ok_or_else(|| "Expecting a JSON value".to_string())
}

/// QEMU's `consume_json`: a second value, or an error after a value, is one value too many.
fn emit(result: &mut Option<Json>, value: Result<Json, String>) -> Result<(), String> {
    let value = value.map_err(|e| at_most_one(result, e))?;
    if result.is_some() {
        return Err("Expecting at most one JSON value".into());
    }
    *result = Some(value);
    Ok(())
}

fn at_most_one(result: &Option<Json>, e: String) -> String {
    match result {
        Some(_) => "Expecting at most one JSON value".into(),
        None => e,
    }
}

/// QEMU's lexer: a token, `None` at the end, or the text of a stray token (from its start to
/// the character that cannot continue it, or to the end).
struct Lexer<'a> {
    text: &'a str,
    at: usize,
}

impl Lexer<'_> {
    fn next(&mut self) -> Result<Option<Token>, String> {
        let rest = &self.text[self.at..];
        let skipped = rest.len() - rest.trim_start_matches([' ', '\t', '\r', '\n']).len();
        self.at += skipped;
        let start = self.at;
        let Some(c) = self.text[start..].chars().next() else {
            return Ok(None);
        };
        self.at += c.len_utf8();
        let token = match c {
            '{' => Token::LCurly,
            '}' => Token::RCurly,
            '[' => Token::LSquare,
            ']' => Token::RSquare,
            ':' => Token::Colon,
            ',' => Token::Comma,
            '"' | '\'' => return self.string(start, c).map(Some),
            '-' | '0'..='9' => return self.number(start).map(Some),
            'a'..='z' => {
                self.take_while(|c| c.is_ascii_lowercase());
                Token::Keyword(self.text[start..self.at].to_string())
            }
            _ => return Err(self.text[start..self.at].to_string()),
        };
        Ok(Some(token))
    }

    fn take_while(&mut self, f: impl Fn(char) -> bool) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start_matches(f).len();
    }

    /// The next character, taken; `None` at the end.
    fn bump(&mut self) -> Option<char> {
        let c = self.text[self.at..].chars().next()?;
        self.at += c.len_utf8();
        Some(c)
    }

    /// A stray token: from `start` through the character just taken.
    fn stray(&self, start: usize) -> String {
        self.text[start..self.at].to_string()
    }

    /// The lexer takes any character but control characters up to the closing quote; escapes
    /// are checked by the parser.
    fn string(&mut self, start: usize, quote: char) -> Result<Token, String> {
        let mut escaped = false;
        loop {
            match self.bump() {
                None => return Err(self.stray(start)),
                Some(c) if (c as u32) < 0x20 => return Err(self.stray(start)),
                Some(_) if escaped => escaped = false,
                Some('\\') => escaped = true,
                Some(c) if c == quote => break,
                Some(_) => {}
            }
        }
        Ok(Token::Str(self.text[start..self.at].to_string()))
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`; a character that cannot follow where
    /// the number needs more makes it stray, as does a digit after a leading zero.
    fn number(&mut self, start: usize) -> Result<Token, String> {
        let peek = |l: &Self| l.text[l.at..].chars().next();
        let first = self.text.as_bytes()[start];
        if first == b'-' {
            match self.bump() {
                Some('0'..='9') => {}
                _ => return Err(self.stray(start)),
            }
        }
        if self.text.as_bytes()[self.at - 1] == b'0' {
            if peek(self).is_some_and(|c| c.is_ascii_digit()) {
                self.bump();
                return Err(self.stray(start));
            }
        } else {
            self.take_while(|c| c.is_ascii_digit());
        }
        if peek(self) == Some('.') {
            self.bump();
            self.digits(start)?;
        }
        if matches!(peek(self), Some('e' | 'E')) {
            self.bump();
            if matches!(peek(self), Some('+' | '-')) {
                self.bump();
            }
            self.digits(start)?;
        }
        Ok(Token::Num(self.text[start..self.at].to_string()))
    }

    /// At least one digit, or the number is stray.
    fn digits(&mut self, start: usize) -> Result<(), String> {
        match self.bump() {
            Some('0'..='9') => {
                self.take_while(|c| c.is_ascii_digit());
                Ok(())
            }
            _ => Err(self.stray(start)),
        }
    }
}

/// QEMU's parser over the tokens of one message.
fn parse_message(tokens: &[Token]) -> Result<Json, String> {
    let mut p = Parser { tokens, at: 0 };
    p.value().map_err(|e| format!("JSON parse error, {e}"))
}

struct Parser<'a> {
    tokens: &'a [Token],
    at: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Result<&Token, String> {
        self.tokens
            .get(self.at)
            .ok_or_else(|| "premature EOI".into())
    }

    fn pop(&mut self) -> Result<&Token, String> {
        let t = self.tokens.get(self.at).ok_or("premature EOI")?;
        self.at += 1;
        Ok(t)
    }

    fn value(&mut self) -> Result<Json, String> {
        let token = self.peek()?.clone();
        match token {
            Token::LCurly => self.object(),
            Token::LSquare => self.array(),
            Token::Str(s) => {
                self.at += 1;
                unquote(&s).map(Json::Str)
            }
            Token::Num(n) => {
                self.at += 1;
                Ok(Json::Num(n))
            }
            Token::Keyword(k) => {
                self.at += 1;
                match k.as_str() {
                    "true" => Ok(Json::Bool(true)),
                    "false" => Ok(Json::Bool(false)),
                    "null" => Ok(Json::Null),
                    _ => Err(format!("invalid keyword '{k}'")),
                }
            }
            _ => Err("expecting value".into()),
        }
    }

    fn object(&mut self) -> Result<Json, String> {
        self.at += 1;
        let mut members: Vec<(String, Json)> = Vec::new();
        if *self.peek()? == Token::RCurly {
            self.at += 1;
            return Ok(Json::Dict(members));
        }
        loop {
            // A key that is not even a value fails as that value does.
            let Json::Str(key) = self.value()? else {
                return Err("key is not a string in object".into());
            };
            if *self.pop()? != Token::Colon {
                return Err("missing : in object pair".into());
            }
            let value = self.value()?;
            if members.iter().any(|(k, _)| *k == key) {
                return Err("duplicate key".into());
            }
            members.push((key, value));
            match self.pop()? {
                Token::RCurly => return Ok(Json::Dict(members)),
                Token::Comma => {}
                _ => return Err("expected separator in dict".into()),
            }
        }
    }

    fn array(&mut self) -> Result<Json, String> {
        self.at += 1;
        let mut items = Vec::new();
        if *self.peek()? == Token::RSquare {
            self.at += 1;
            return Ok(Json::List(items));
        }
        loop {
            items.push(self.value()?);
            match self.pop()? {
                Token::RSquare => return Ok(Json::List(items)),
                Token::Comma => {}
                _ => return Err("expected separator in list".into()),
            }
        }
    }
}

/// The text of a quoted string token, its escapes resolved as QEMU's `parse_string` does.
fn unquote(token: &str) -> Result<String, String> {
    let body = &token[1..token.len() - 1];
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let escaped = match chars.next().map(|(_, e)| e) {
            Some('"') => '"',
            Some('\'') => '\'',
            Some('\\') => '\\',
            Some('/') => '/',
            Some('b') => '\u{8}',
            Some('f') => '\u{c}',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('t') => '\t',
            Some('u') => {
                let rest = &body[i + 2..];
                let (c, used) = unicode_escape(rest);
                for _ in 0..used {
                    chars.next();
                }
                match c {
                    Some(c) => c,
                    None => {
                        let end = (i + 2 + used).min(body.len());
                        let text = body.get(i..end).unwrap_or(&body[i..]);
                        return Err(format!("{text} is not a valid Unicode character"));
                    }
                }
            }
            _ => return Err("invalid escape sequence in string".into()),
        };
        out.push(escaped);
    }
    Ok(out)
}

/// The character of the `\u` escape whose hex digits start `rest` (a surrogate pair taking a
/// second escape), and how many characters of `rest` it used.
fn unicode_escape(rest: &str) -> (Option<char>, usize) {
    let hex4 = |s: &str| {
        let digits = s.get(..4)?;
        digits
            .bytes()
            .all(|b| b.is_ascii_hexdigit())
            .then(|| u32::from_str_radix(digits, 16).ok())?
    };
    let Some(cp) = hex4(rest) else {
        return (None, rest.chars().take(4).count());
    };
    if (0xD800..0xDC00).contains(&cp) && rest[4..].starts_with("\\u") {
        let c = hex4(&rest[6..])
            .filter(|t| (0xDC00..0xE000).contains(t))
            .and_then(|t| char::from_u32(0x10000 + ((cp & 0x3FF) << 10) + (t & 0x3FF)));
        return (c, if c.is_some() { 10 } else { 4 });
    }
    (char::from_u32(cp).filter(|&c| !noncharacter(c)), 4)
}

/// Code points QEMU's `is_valid_codepoint` refuses besides surrogates.
fn noncharacter(c: char) -> bool {
    let cp = c as u32;
    (0xFDD0..=0xFDEF).contains(&cp) || cp & 0xFFFE == 0xFFFE
}

/// QEMU's `tdb_hash` (qobject/qdict.c), which places a QDict's members in its buckets.
fn tdb_hash(name: &str) -> u32 {
    let bytes = name.as_bytes();
    let mut value = 0x238F_13AFu32.wrapping_mul(bytes.len() as u32);
    for (i, &c) in bytes.iter().enumerate() {
        value = value.wrapping_add(u32::from(c) << ((i as u32 * 5) % 24));
    }
    1_103_515_243u32.wrapping_mul(value).wrapping_add(12345)
}

/// The order QEMU iterates a QDict's members in: a hash table of 512 buckets, bucket by bucket,
/// each bucket newest first. Everything QEMU prints from a QDict comes out in this order.
pub fn qdict_order<T>(members: &[(String, T)]) -> Vec<&(String, T)> {
    let mut ordered: Vec<(u32, usize, &(String, T))> = members
        .iter()
        .enumerate()
        .map(|(i, m)| (tdb_hash(&m.0) % 512, i, m))
        .collect();
    ordered.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    ordered.into_iter().map(|(_, _, m)| m).collect()
}

/// Writes a string as QEMU's JSON output quotes it.
pub fn quote(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04X}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

impl Json {
    /// The value as QEMU's `qobject_to_json` writes it on one line (`json:` file names).
    pub fn compact(&self) -> String {
        let mut out = String::new();
        self.write_compact(&mut out);
        out
    }

    fn write_compact(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Num(n) => out.push_str(n),
            Json::Str(s) => quote(out, s),
            Json::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    out.push_str(if i == 0 { "" } else { ", " });
                    item.write_compact(out);
                }
                out.push(']');
            }
            Json::Dict(members) => {
                out.push('{');
                for (i, (k, v)) in qdict_order(members).into_iter().enumerate() {
                    out.push_str(if i == 0 { "" } else { ", " });
                    quote(out, k);
                    out.push_str(": ");
                    v.write_compact(out);
                }
                out.push('}');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(text).unwrap_err()
    }

    #[test]
    fn values_parse_with_qemu_extensions() {
        let v = parse(r#" {'a': "x\u00e9\"", "b": [1, -2.5e3, true, null], "c": {}} "#).unwrap();
        let Json::Dict(m) = v else { panic!() };
        assert_eq!(m[0], ("a".into(), Json::Str("xé\"".into())));
        assert_eq!(
            m[1].1,
            Json::List(vec![
                Json::Num("1".into()),
                Json::Num("-2.5e3".into()),
                Json::Bool(true),
                Json::Null
            ])
        );
        assert_eq!(m[2].1, Json::Dict(vec![]));
        assert_eq!(parse(r#""\ud83d\ude00""#).unwrap(), Json::Str("😀".into()));
    }

    /// Each message as qemu-img 10.0.2 prints it for `json:` followed by the input.
    #[test]
    fn errors_read_as_qemus() {
        let cases = [
            (r#"{"a":1}}"#, "Expecting at most one JSON value"),
            (r#"{"a":1}{"b":2}"#, "Expecting at most one JSON value"),
            (r#"{"a":1"#, "JSON parse error, premature EOI"),
            (r#"{"a" 1}"#, "JSON parse error, missing : in object pair"),
            ("{1:2}", "JSON parse error, key is not a string in object"),
            (
                r#"{"a":1 "b":2}"#,
                "JSON parse error, expected separator in dict",
            ),
            (
                r#"{"a":[1 2]}"#,
                "JSON parse error, expected separator in list",
            ),
            (r#"{"a":tru}"#, "JSON parse error, invalid keyword 'tru'"),
            (
                r#"{"a":"\x"}"#,
                "JSON parse error, invalid escape sequence in string",
            ),
            (r#"{"a":@}"#, "JSON parse error, stray '@'"),
            ("   ", "Expecting a JSON value"),
            ("", "Expecting a JSON value"),
            (r#"{"a":1,"a":2}"#, "JSON parse error, duplicate key"),
            (r#"{"a":-}"#, "JSON parse error, stray '-}'"),
            (r#"{"a":01}"#, "JSON parse error, stray '01'"),
            (r#"{"a":1.}"#, "JSON parse error, stray '1.}'"),
            (
                r#"{"a":"\ud800"}"#,
                "JSON parse error, \\ud800 is not a valid Unicode character",
            ),
            (r#"{"a":[}"#, "JSON parse error, expecting value"),
            (r#"{"a":[1,]}"#, "JSON parse error, expecting value"),
            (r#"{"a":}"#, "JSON parse error, expecting value"),
            ("{,}", "JSON parse error, expecting value"),
            (r#"{"a":1,}"#, "JSON parse error, expecting value"),
            (r#"{"a""#, "JSON parse error, premature EOI"),
            ("{", "JSON parse error, premature EOI"),
            ("}", "JSON parse error, expecting value"),
            (r#"{"a":"b"#, "JSON parse error, stray '\"b'"),
            (r#"{"a" 1 @}"#, "JSON parse error, stray '@'"),
            (r#"{} @"#, "Expecting at most one JSON value"),
        ];
        for (input, want) in cases {
            assert_eq!(err(input), want, "input {input}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_without_recursing() {
        let deep = "[".repeat(100_000);
        assert_eq!(err(&deep), "JSON nesting depth limit exceeded");
        let ok = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        assert!(parse(&ok).is_ok());
    }

    #[test]
    fn compact_output_is_qemus() {
        let v = parse(r#"{"size": 1048576, "driver": "null-co"}"#).unwrap();
        assert_eq!(v.compact(), r#"{"driver": "null-co", "size": 1048576}"#);
        let v = parse(r#"{"file": {"size": 1, "driver": "null-co"}, "driver": "raw"}"#).unwrap();
        assert_eq!(
            v.compact(),
            r#"{"driver": "raw", "file": {"driver": "null-co", "size": 1}}"#
        );
    }
}
