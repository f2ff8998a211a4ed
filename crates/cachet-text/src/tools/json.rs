//! An incremental scanner of one tool-call JSON object: `{"name": "...", "<args>": ...}` with
//! the keys in any order and any other keys ignored.

/// Where the scanner is in the object's top level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Top {
    /// Before the opening `{`.
    Open,
    ExpectKey,
    InKey,
    ExpectColon,
    ExpectValue,
    /// Inside a value: a string (at depth 1), a nested object/array (depth > 1) or a scalar.
    InValue,
    AfterValue,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Name,
    Args,
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Str,
    Nested,
    Scalar,
}

/// Scans one call object as its text arrives (see [`CallScanner::feed`]).
#[derive(Debug)]
pub struct CallScanner {
    args_key: &'static str,
    top: Top,
    depth: u32,
    in_str: bool,
    esc: bool,
    key: String,
    field: Field,
    kind: Kind,
    name_raw: String,
    name: Option<String>,
    args: String,
    args_emitted: usize,
    args_is_string: bool,
    done: bool,
    failed: bool,
    /// Set by the parser once it announced the call.
    pub(crate) started: bool,
    pub(crate) index: usize,
}

impl CallScanner {
    pub fn new(args_key: &'static str) -> Self {
        CallScanner {
            args_key,
            top: Top::Open,
            depth: 0,
            in_str: false,
            esc: false,
            key: String::new(),
            field: Field::Other,
            kind: Kind::Scalar,
            name_raw: String::new(),
            name: None,
            args: String::new(),
            args_emitted: 0,
            args_is_string: false,
            done: false,
            failed: false,
            started: false,
            index: 0,
        }
    }

    /// The call's name, once its string is complete.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The object closed.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The text is not a JSON object.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Argument text scanned since the last call (nothing while the value is a JSON string:
    /// that one is decoded whole by [`CallScanner::finish_args`]).
    pub fn take_args(&mut self) -> String {
        if self.args_is_string {
            return String::new();
        }
        let s = self.args[self.args_emitted..].to_string();
        self.args_emitted = self.args.len();
        s
    }

    /// What is left of the arguments at the call's end.
    pub fn finish_args(&mut self) -> String {
        if self.args_is_string {
            self.args_is_string = false;
            let decoded = serde_json::from_str::<String>(self.args.trim()).unwrap_or_default();
            self.args_emitted = self.args.len();
            return decoded;
        }
        // A scalar value still open at the end (`"arguments": 5}` is closed by the brace).
        let rest = self.args[self.args_emitted..].trim_end().to_string();
        self.args_emitted = self.args.len();
        rest
    }

    fn value_done(&mut self) {
        if self.field == Field::Name {
            self.name = serde_json::from_str::<String>(&self.name_raw).ok();
        }
        if self.field == Field::Args && self.kind == Kind::Scalar {
            let t = self.args.trim_end().len();
            self.args.truncate(t);
        }
        self.top = Top::AfterValue;
    }

    fn push_field(&mut self, c: char) {
        match self.field {
            Field::Name => self.name_raw.push(c),
            Field::Args => self.args.push(c),
            Field::Other => {}
        }
    }

    /// Scans `input`; returns how many bytes belong to the object (all of it unless the
    /// object closed inside it, or it is not an object).
    pub fn feed(&mut self, input: &str) -> usize {
        for (i, c) in input.char_indices() {
            if self.done || self.failed {
                return i;
            }
            self.step(c);
            if self.failed {
                return i;
            }
        }
        input.len()
    }

    fn step(&mut self, c: char) {
        // Inside a string anywhere: escapes and the closing quote.
        if self.in_str {
            let closing = !self.esc && c == '"';
            self.esc = !self.esc && c == '\\';
            match self.top {
                Top::InKey => {
                    if closing {
                        self.in_str = false;
                        self.top = Top::ExpectColon;
                    } else {
                        self.key.push(c);
                    }
                }
                Top::InValue => {
                    self.push_field(c);
                    if closing {
                        self.in_str = false;
                        if self.kind == Kind::Str && self.depth == 1 {
                            self.value_done();
                        }
                    }
                }
                _ => {}
            }
            return;
        }
        match self.top {
            Top::Open => {
                if c == '{' {
                    self.depth = 1;
                    self.top = Top::ExpectKey;
                } else if !c.is_whitespace() {
                    self.failed = true;
                }
            }
            Top::ExpectKey => match c {
                '"' => {
                    self.key.clear();
                    self.in_str = true;
                    self.top = Top::InKey;
                }
                '}' => self.close(),
                c if c.is_whitespace() || c == ',' => {}
                _ => self.failed = true,
            },
            Top::InKey => {}
            Top::ExpectColon => match c {
                ':' => self.top = Top::ExpectValue,
                c if c.is_whitespace() => {}
                _ => self.failed = true,
            },
            Top::ExpectValue => {
                if c.is_whitespace() {
                    return;
                }
                self.field = if self.key == "name" {
                    Field::Name
                } else if self.key == self.args_key || self.key == "arguments" {
                    Field::Args
                } else {
                    Field::Other
                };
                if self.field == Field::Name {
                    self.name_raw.clear();
                }
                if self.field == Field::Args {
                    self.args.clear();
                    self.args_emitted = 0;
                    self.args_is_string = c == '"';
                }
                self.push_field(c);
                self.top = Top::InValue;
                match c {
                    '{' | '[' => {
                        self.kind = Kind::Nested;
                        self.depth += 1;
                    }
                    '"' => {
                        self.kind = Kind::Str;
                        self.in_str = true;
                    }
                    _ => self.kind = Kind::Scalar,
                }
            }
            Top::InValue => match self.kind {
                Kind::Nested => {
                    self.push_field(c);
                    match c {
                        '"' => self.in_str = true,
                        '{' | '[' => self.depth += 1,
                        '}' | ']' => {
                            self.depth -= 1;
                            if self.depth == 1 {
                                self.value_done();
                            }
                        }
                        _ => {}
                    }
                }
                Kind::Scalar => match c {
                    ',' => {
                        self.value_done();
                        self.top = Top::ExpectKey;
                    }
                    '}' => {
                        self.value_done();
                        self.close();
                    }
                    _ => self.push_field(c),
                },
                Kind::Str => {}
            },
            Top::AfterValue => match c {
                ',' => self.top = Top::ExpectKey,
                '}' => self.close(),
                c if c.is_whitespace() => {}
                _ => self.failed = true,
            },
        }
    }

    fn close(&mut self) {
        self.depth = 0;
        self.done = true;
    }
}
